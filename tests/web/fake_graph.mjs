// A minimal stand-in for the LiteGraph node/graph surface the extension touches, for Node-only tests.
// It mirrors the calls of ComfyUI's front end (LGraphNode.addWidget / findInputSlot / getInputNode /
// setDirtyCanvas, graph._links as a Map, LGraphNode.serialize skipping `widget.serialize === false`), nothing more.

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

  setDirtyCanvas() {}
}

/** Node class per ComfyUI type, so extensions can patch `prototype` in beforeRegisterNodeDef. */
export function nodeClass(comfyClass) {
  return class FakeNode {
    static comfyClass = comfyClass;

    constructor({ inputs = [], widgets = [] } = {}) {
      this.comfyClass = comfyClass;
      this.type = comfyClass;
      this.mode = 0;
      this.dirty = 0;
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

    /** As LGraphNode.serialize(): each value at its widget's index, skipping serialize === false. */
    serialize() {
      const widgets_values = [];
      const widgets_values_named = {};
      for (const [i, widget] of this.widgets.entries()) {
        if (widget.serialize === false) continue;
        widgets_values[i] = widget.value;
        widgets_values_named[widget.name] = widget.value;
      }
      return { widgets_values, widgets_values_named };
    }

    /** As graphToPrompt: widgets whose options.serialize is not false go into the API prompt. */
    promptInputs() {
      return Object.fromEntries(
        this.widgets.filter((w) => w.name && w.options?.serialize !== false).map((w) => [w.name, w.value]),
      );
    }
  };
}
