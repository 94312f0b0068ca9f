// A minimal stand-in for the LiteGraph node/graph surface the extension touches, for Node-only tests.
// It mirrors the calls of ComfyUI's front end (LGraphNode.addWidget / findInputSlot / getInputNode /
// setDirtyCanvas, graph._links as a Map, LGraphNode.serialize skipping `widget.serialize === false`, and, for
// classes made with `{ domWidgets: true }`, the front end's addDOMWidget / computeSize / setSize), nothing more.

export class FakeGraph {
  constructor() {
    this._nodes = [];
    this._links = new Map();
    this.nextId = 1;
  }

  add(node) {
    node.id = this.nextId++;
    node.graph = this;
    this._nodes.push(node);
    node.onAdded?.(this);
    return node;
  }

  getNodeById(id) {
    return this._nodes.find((n) => n.id === id) ?? null;
  }

  /** Link `source`'s output 0 into `target`'s input `name`. */
  connect(source, target, name) {
    const slot = target.findInputSlot(name);
    if (slot < 0) throw new Error(`no input ${name}`);
    const id = this.nextId++;
    this._links.set(id, { id, origin_id: source.id, origin_slot: 0, target_id: target.id, target_slot: slot });
    target.inputs[slot].link = id;
    target.onConnectionsChange?.(1, slot, true, this._links.get(id), target.inputs[slot]);
  }

  /** As LGraph.remove: the node's onRemoved hook runs, the node leaves the graph. */
  remove(node) {
    node.onRemoved?.();
    this._nodes = this._nodes.filter((n) => n !== node);
    node.graph = null;
  }

  setDirtyCanvas() {}
}

const WIDGET_HEIGHT = 24; // LiteGraph.NODE_WIDGET_HEIGHT
const TITLE_HEIGHT = 30;

/** Node class per ComfyUI type, so extensions can patch `prototype` in beforeRegisterNodeDef. */
export function nodeClass(comfyClass, { domWidgets = false } = {}) {
  const FakeNode = class FakeNode {
    static comfyClass = comfyClass;

    constructor({ inputs = [], widgets = [] } = {}) {
      this.comfyClass = comfyClass;
      this.type = comfyClass;
      this.title = comfyClass;
      this.mode = 0;
      this.dirty = 0;
      this.properties = {};
      this.size = [315, 200];
      this.flags = {};
      this.inputs = inputs.map((name) => ({ name, link: null }));
      this.widgets = [];
      for (const [type, name, value, options] of widgets) {
        this.addWidget(type, name, value, () => {}, { ...(options ?? {}) });
      }
    }

    addWidget(type, name, value, callback, options) {
      if (type === "combo" && !options?.values) throw new Error("combo needs values");
      const widget = { type, name, value, callback, options: options ?? {}, y: 0 };
      this.widgets.push(widget);
      return widget;
    }

    findInputSlot(name) {
      return this.inputs.findIndex((input) => input.name === name);
    }

    getInputNode(slot) {
      const input = this.inputs[slot];
      if (!input || input.link === null) return null;
      const link = this.graph._links.get(input.link);
      return link ? this.graph.getNodeById(link.origin_id) : null;
    }

    setDirtyCanvas() {
      this.dirty += 1;
    }

    /** As LGraphNode.computeSize(): a row per plain widget, a DOM widget's minimum height. */
    computeSize() {
      let height = TITLE_HEIGHT + WIDGET_HEIGHT * Math.max(this.inputs.length, 1);
      for (const widget of this.widgets) height += widget.element ? widget.options.getMinHeight?.() ?? 50 : WIDGET_HEIGHT;
      return [this.size[0], height];
    }

    setSize(size) {
      this.size = [...size];
    }

    /** As LGraphNode.serialize(): each value at its widget's index, skipping serialize === false. */
    serialize() {
      const widgets_values = [];
      const widgets_values_named = {};
      for (const [i, widget] of this.widgets.entries()) {
        if (widget.serialize === false) continue;
        widgets_values[i] = widget.value;
        widgets_values_named[widget.name] = widget.value;
      }
      return { id: this.id, type: this.type, title: this.title, properties: structuredClone(this.properties),
        widgets_values, widgets_values_named };
    }

    /** As graphToPrompt: widgets whose options.serialize is not false go into the API prompt. */
    promptInputs() {
      return Object.fromEntries(
        this.widgets.filter((w) => w.name && w.options?.serialize !== false).map((w) => [w.name, w.value]),
      );
    }
  };
  if (domWidgets) {
    /** As the front end's LGraphNode.addDOMWidget: the widget's value goes through options.getValue/setValue. */
    FakeNode.prototype.addDOMWidget = function (name, type, element, options = {}) {
      const widget = {
        name, type, element, options, y: 0,
        get value() { return options.getValue?.(); },
        set value(v) { options.setValue?.(v); },
      };
      this.widgets.push(widget);
      return widget;
    };
  }
  return FakeNode;
}

/** Just enough of `document` for a DOM widget: createElement, className/style/title, replaceChildren. */
export class FakeElement {
  constructor(tag) {
    this.tagName = tag.toUpperCase();
    this.className = "";
    this.style = {};
    this.title = "";
    this.attributes = {};
    this.children = [];
    this.ownText = "";
  }

  setAttribute(name, value) {
    this.attributes[name] = String(value);
  }

  appendChild(child) {
    this.children.push(child);
    return child;
  }

  replaceChildren(...children) {
    this.children = children;
    this.ownText = "";
  }

  get textContent() {
    return this.ownText + this.children.map((c) => c.textContent).join("");
  }

  set textContent(text) {
    this.children = [];
    this.ownText = String(text);
  }
}

export const fakeDocument = { createElement: (tag) => new FakeElement(tag), hidden: false };
