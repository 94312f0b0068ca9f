"""Start N ComfyUI workers (each its own --port and --base-directory) and HAProxy in front of them, on one machine.

    python deploy/start_workers.py --comfyui /path/to/ComfyUI --workers 3 --base /srv/qi21 \\
        --models /path/to/ComfyUI/models [--port 8188] [--python /path/to/python] [-- extra ComfyUI args]

Worker i listens on 127.0.0.1:(port + i) with the base directory <base>/w<i> (its own input/, output/, user/ and a
link to the shared models folder and to this pack under custom_nodes/); HAProxy listens on 127.0.0.1:<port> with
deploy/haproxy.cfg, its server lines rewritten for these workers. Logs go to <base>/w<i>/comfyui.log and
<base>/haproxy.log. Runs until Ctrl-C, then stops what it started.

The functions are what tests/test_many_workers.py uses to build the same farm around tiny models.
"""

import argparse
import os
import re
import shutil
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

DEPLOY = Path(__file__).resolve().parent
REPO = DEPLOY.parent
CONFIG = DEPLOY / "haproxy.cfg"
MARKER = "    # -- workers (deploy/start_workers.py writes the lines below) --"


def render_config(workers: list[tuple[str, int]], port: int, roundrobin_port: int | None = None,
                  template: str | None = None) -> str:
    """deploy/haproxy.cfg for these `(name, port)` workers, listening on `port`. With `roundrobin_port`, a second
    listener over the same workers balances the jobs' first requests round robin instead (the comparison the
    measurements in docs/many-workers.md make); pinning by X-QI21-Worker is the same in both."""
    text = CONFIG.read_text() if template is None else template
    head, marker, _ = text.partition(MARKER)
    if not marker:
        raise ValueError(f"{CONFIG} lost its marker line {MARKER.strip()!r}")
    head = re.sub(r"bind 127\.0\.0\.1:\d+", f"bind 127.0.0.1:{port}", head)
    pins = [f"    use-server {name} if {{ req.hdr(X-QI21-Worker) -m str {name} }}" for name, _ in workers]
    servers = [f"    server {name} 127.0.0.1:{worker_port}" for name, worker_port in workers]
    out = head + marker + "\n" + "\n".join(pins + servers) + "\n"
    if roundrobin_port is not None:
        backend = head[head.index("\nbackend qi21_workers") + 1:].replace("backend qi21_workers",
                                                                          "backend qi21_roundrobin")
        backend = backend.replace("balance hdr(X-QI21-Route-Key)", "balance roundrobin")
        out += (f"\nfrontend qi21_rr\n    bind 127.0.0.1:{roundrobin_port}\n    default_backend qi21_roundrobin\n\n"
                + backend + marker + "\n" + "\n".join(pins + servers) + "\n")
    return out


def prepare_worker(base: Path, models: Path) -> None:
    """A worker's base directory: input/, output/, temp/, user/, the shared models folder, this pack."""
    for name in ("input", "output", "temp", "user/default", "custom_nodes"):
        (base / name).mkdir(parents=True, exist_ok=True)
    if not (base / "models").exists():
        (base / "models").symlink_to(Path(models).resolve(), target_is_directory=True)
    pack = base / "custom_nodes" / "ComfyUI-QwenImage21"
    if not pack.exists():
        pack.symlink_to(REPO, target_is_directory=True)


def start_worker(comfyui: Path, python: str, base: Path, port: int, extra=(), env=None) -> subprocess.Popen:
    command = [python, "main.py", "--listen", "127.0.0.1", "--port", str(port), "--base-directory", str(base),
               "--disable-auto-launch", *extra]
    log = open(base / "comfyui.log", "w")  # noqa: SIM115  (open as long as the worker runs)
    return subprocess.Popen(command, cwd=comfyui, env=env, stdout=log, stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL)


def wait_until_up(port: int, proc: subprocess.Popen, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the worker on port {port} exited with code {proc.returncode} while starting")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/system_stats", timeout=5):
                return
        except OSError:
            time.sleep(0.5)
    raise RuntimeError(f"the worker on port {port} did not answer /system_stats within {timeout} s")


def start_haproxy(config_text: str, folder: Path, haproxy: str = "haproxy") -> subprocess.Popen:
    path = folder / "haproxy.cfg"
    path.write_text(config_text)
    subprocess.run([haproxy, "-c", "-q", "-f", str(path)], check=True)
    log = open(folder / "haproxy.log", "w")  # noqa: SIM115
    return subprocess.Popen([haproxy, "-db", "-f", str(path)], stdout=log, stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL)


def stop(proc: subprocess.Popen | None) -> None:
    if proc is not None and proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=20)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--comfyui", required=True, type=Path, help="the ComfyUI checkout (holds main.py)")
    parser.add_argument("--models", required=True, type=Path, help="the models folder every worker shares")
    parser.add_argument("--base", required=True, type=Path, help="where the workers' base directories go")
    parser.add_argument("--workers", type=int, default=3)
    parser.add_argument("--port", type=int, default=8188, help="HAProxy's port; worker i gets port + i")
    parser.add_argument("--python", default=sys.executable, help="the interpreter that runs ComfyUI")
    parser.add_argument("--haproxy", default=shutil.which("haproxy") or "haproxy")
    parser.add_argument("extra", nargs="*", help="more ComfyUI arguments (after --), e.g. --cpu")
    args = parser.parse_args(argv)
    if not (args.comfyui / "main.py").is_file():
        parser.error(f"--comfyui {args.comfyui}: no main.py there")
    if args.workers < 1:
        parser.error("--workers must be at least 1")
    workers = [(f"w{i}", args.port + i) for i in range(1, args.workers + 1)]
    procs = []
    try:
        for name, port in workers:
            base = args.base / name
            prepare_worker(base, args.models)
            procs.append(start_worker(args.comfyui, args.python, base, port, args.extra, env=dict(os.environ)))
        for (name, port), proc in zip(workers, procs):
            wait_until_up(port, proc)
            print(f"{name}: http://127.0.0.1:{port} (log {args.base / name / 'comfyui.log'})")
        procs.append(start_haproxy(render_config(workers, args.port), args.base, args.haproxy))
        print(f"HAProxy: http://127.0.0.1:{args.port} -> {len(workers)} workers. Ctrl-C stops everything.")
        while all(proc.poll() is None for proc in procs):
            time.sleep(1)
        print("a process ended; stopping the rest", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 0
    finally:
        for proc in reversed(procs):
            stop(proc)


if __name__ == "__main__":
    sys.exit(main())
