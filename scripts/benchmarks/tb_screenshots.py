"""Screenshots of TensorBoard as a user sees it, taken with headless Chromium: the images of
docs/tensorboard.md (of the runs of docs/compare_modes.md).

    python scripts/benchmarks/tb_screenshots.py --logdir runs/compare --out shots/
    python scripts/benchmarks/tb_screenshots.py --logdir runs/compare --out docs/ \\
        --only custom_scalars

Starts TensorBoard on 127.0.0.1 (a free port), waits until it lists the runs, loads each
view in headless Chromium and saves `<out>/tb_<view>.png`, then stops TensorBoard.
Chromium comes from the distribution (Debian: `apt-get install chromium`); `--chromium`
names another binary. Each PNG is reduced to a palette of 256 colours, which keeps a
screenshot of charts under ~200 KB without blurring its text.
"""

from __future__ import annotations

import argparse
import json
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

# TensorBoard's defaults smooth lines (0.6) and leave "outliers" out of the y range: with
# two or three points per line (one per world size) the first moves the points and the
# second cuts off the lowest line. The shots turn both off, as docs/tensorboard.md tells users to:
# smoothing in the URL, the outlier box in localStorage, where TensorBoard keeps it.
RAW = "&_smoothingWeight=0"
SETTINGS = {"_ignoreYOutliers": "false"}
# view name -> (URL fragment after the host, window height in pixels)
VIEWS = {
    "custom_scalars": ("/#custom_scalars" + RAW, 1000),
    "scalars_memory": ("/#scalars&tagFilter=memory" + RAW, 1500),
    "text": ("/#text", 700),
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for_runs(url: str, timeout_s: float) -> list[str]:
    """Poll TensorBoard's run list until it has loaded some runs."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"{url}/data/runs", timeout=5) as r:
                runs = json.loads(r.read())
            if runs:
                time.sleep(3)  # let the reload that found them finish its pass
                return runs
        except OSError:
            pass
        time.sleep(1)
    raise SystemExit(f"error: TensorBoard at {url} listed no runs within {timeout_s:.0f} s")


class Chromium:
    """Headless Chromium driven over its DevTools pipe (`--remote-debugging-pipe`: JSON
    messages ending in a NUL byte on fds 3 and 4), stdlib only. The pipe lets a shot set
    TensorBoard's settings, which it keeps in the page's localStorage, not in the URL."""

    def __init__(self, binary: str, width: int, height: int):
        import os

        self._to_r, self._to_w = os.pipe()  # we write, Chromium reads on its fd 3
        self._from_r, self._from_w = os.pipe()  # Chromium writes on its fd 4
        self._proc = subprocess.Popen(
            [binary, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars"]
            + [f"--window-size={width},{height}", "--remote-debugging-pipe", "about:blank"],
            # fds 3 and 4 are set in the child just before exec; close_fds would shut them
            close_fds=False,
            preexec_fn=self._pipe_fds,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        os.close(self._to_r)
        os.close(self._from_w)
        self._out = os.fdopen(self._to_w, "wb", buffering=0)
        self._in = os.fdopen(self._from_r, "rb", buffering=0)
        self._buf, self._id = b"", 0
        targets = self.call("Target.getTargets")["targetInfos"]
        page = next(t for t in targets if t["type"] == "page")
        self._session = self.call("Target.attachToTarget", targetId=page["targetId"], flatten=True)[
            "sessionId"
        ]
        self.call("Emulation.setDeviceMetricsOverride", width=width, height=height,
                  deviceScaleFactor=1, mobile=False, session=True)  # fmt: skip

    def _pipe_fds(self) -> None:  # in the child: our pipe ends become its fds 3 and 4
        import os

        read, write = os.dup(self._to_r), os.dup(self._from_w)  # may themselves be 3 or 4
        os.dup2(read, 3)
        os.dup2(write, 4)

    def call(self, method: str, session: bool = False, **params) -> dict:
        self._id += 1
        msg = {"id": self._id, "method": method, "params": params}
        if session:
            msg["sessionId"] = self._session
        self._out.write(json.dumps(msg).encode() + b"\0")
        while True:
            while b"\0" not in self._buf:
                chunk = self._in.read(1 << 16)
                if not chunk:
                    raise SystemExit("error: chromium exited")
                self._buf += chunk
            raw, self._buf = self._buf.split(b"\0", 1)
            reply = json.loads(raw)
            if reply.get("id") == self._id:
                if "error" in reply:
                    raise SystemExit(f"error: chromium {method}: {reply['error']}")
                return reply["result"]

    def shoot(self, url: str, path: Path, wait_s: float, local_storage: dict) -> None:
        self.call("Page.navigate", url=url, session=True)
        time.sleep(2)
        js = "".join(f"localStorage.setItem({json.dumps(k)}, {json.dumps(v)});"
                     for k, v in local_storage.items())  # fmt: skip
        self.call("Runtime.evaluate", expression=js, session=True)
        self.call("Page.reload", session=True)
        time.sleep(wait_s)
        shot = self.call("Page.captureScreenshot", format="png", session=True)
        import base64

        path.write_bytes(base64.b64decode(shot["data"]))
        shrink(path)

    def close(self) -> None:
        self._proc.terminate()
        self._proc.wait(timeout=30)


def shrink(path: Path) -> None:
    """256-colour palette: charts have few colours; text stays sharp."""
    from PIL import Image

    with Image.open(path) as im:
        small = im.convert("RGB").quantize(colors=256, method=Image.Quantize.MEDIANCUT)
    small.save(path, optimize=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--logdir", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True, help="folder for tb_<view>.png")
    ap.add_argument("--only", default=",".join(VIEWS), help=f"views: {', '.join(VIEWS)}")
    ap.add_argument("--width", type=int, default=1400)
    ap.add_argument("--wait-s", type=float, default=12, help="page time before the shot")
    ap.add_argument("--chromium", default=shutil.which("chromium") or "chromium")
    args = ap.parse_args()
    views = args.only.split(",")
    if unknown := [v for v in views if v not in VIEWS]:
        ap.error(f"--only: unknown view(s) {unknown}; choose from {', '.join(VIEWS)}")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    tb = subprocess.Popen(
        [sys.executable, "-m", "tensorboard.main", "--logdir", str(args.logdir)]
        + ["--host", "127.0.0.1", "--port", str(port), "--reload_interval", "5"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    browser = None
    try:
        print(f"TensorBoard at {url}: runs {wait_for_runs(url, 120)}")
        args.out.mkdir(parents=True, exist_ok=True)
        for view in views:
            fragment, height = VIEWS[view]
            browser = Chromium(args.chromium, args.width, height)
            path = args.out / f"tb_{view}.png"
            browser.shoot(url + "/" + fragment.lstrip("/"), path, args.wait_s, SETTINGS)
            browser.close()
            browser = None
            print(f"{path} ({path.stat().st_size // 1024} KB)")
    finally:
        if browser is not None:
            browser.close()
        tb.terminate()
        tb.wait(timeout=30)


if __name__ == "__main__":
    main()
