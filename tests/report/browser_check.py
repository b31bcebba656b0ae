"""A real browser opens `ft report`'s pages: headless Chromium (Debian's `chromium`, installed by
scripts/setup.sh) loads the report of a finished 2-rank run and of a preempted and resumed run.

For each page it checks that
  * the screenshot is not blank: the PNG is decoded here (zlib and the PNG filters, stdlib only)
    and must show many colours, none covering nearly all of it;
  * the DOM Chromium built (--dump-dom) has every figure, and each drawn series the number of
    points the run has (data-series / data-points, and the polyline's own point count);
  * the page loads nothing: no http(s) URL, no src=, no script in the file, and Chromium runs
    with every host name unresolvable (--host-resolver-rules) so nothing could load anyway.

Exit status: 0 pass, 1 failure, 77 skipped (no chromium here, or one that cannot start headless;
under CI either fails).
With --keep DIR the runs, pages and screenshots stay in DIR; docs/report.png is DIR/finished.png of

    python3 tests/report/browser_check.py --ft build/bin/ft --keep DIR --steps 120
"""
import argparse
import os
import re
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
import zlib

SKIP = 77
CI = os.environ.get("CI", "") not in ("", "0", "false")
WINDOW = (1280, 2300)


def fail(msg):
    raise SystemExit(f"FAIL: {msg}")


def find_chromium():
    for name in (os.environ.get("CHROMIUM", ""), "chromium", "chromium-browser", "google-chrome"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def train_argv(ft, out, steps):
    return [ft, "launch", "--standalone", "--nproc-per-node", "2", "--master-port", str(free_port()),
            "--", ft, "train", "--preset", "tiny-demo", "--output", out,
            "--set", f"train.max_steps={steps}", "--set", "output.save_every=4"]


def run(argv, log, env=None):
    with open(log, "w") as f:
        rc = subprocess.call(argv, stdout=f, stderr=subprocess.STDOUT, env=env)
    return rc, open(log).read()


def metrics_lines(out):
    try:
        return sum(1 for line in open(os.path.join(out, "metrics.jsonl")) if line.endswith("\n"))
    except FileNotFoundError:
        return 0


def finished_run(ft, work, steps):
    out = os.path.join(work, "finished")
    rc, text = run(train_argv(ft, out, steps), os.path.join(work, "finished.log"))
    if rc != 0:
        print(text)
        fail(f"the 2-rank run exited with {rc}")
    return out, steps


def resumed_run(ft, work):
    """A run stopped by SIGTERM mid-way (exit 75, checkpoint written), then the same command."""
    out = os.path.join(work, "resumed")
    argv = train_argv(ft, out, 12)
    env = {**os.environ, "FT_FAULT_STEP_DELAY": "0:0.15"}
    with open(os.path.join(work, "resumed-1.log"), "w") as f:
        p = subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT, env=env)
    deadline = time.time() + 120
    while metrics_lines(out) < 5 and time.time() < deadline and p.poll() is None:
        time.sleep(0.05)
    p.send_signal(signal.SIGTERM)
    if p.wait(timeout=60) != 75:
        print(open(os.path.join(work, "resumed-1.log")).read())
        fail(f"the stopped run exited with {p.returncode}, expected 75 (preempted)")
    rc, text = run(argv, os.path.join(work, "resumed-2.log"))
    if rc != 0 or "resuming from" not in text:
        print(text)
        fail(f"the resumed run exited with {rc} (or did not resume)")
    return out, 12


def png_pixels(path):
    """(width, height, rows of RGB(A) bytes) of an 8-bit RGB or RGBA PNG."""
    data = open(path, "rb").read()
    if data[:8] != b"\x89PNG\r\n\x1a\n":
        fail(f"{path} is not a PNG")
    pos, idat, ihdr = 8, b"", None
    while pos < len(data):
        (length,) = struct.unpack(">I", data[pos:pos + 4])
        kind = data[pos + 4:pos + 8]
        body = data[pos + 8:pos + 8 + length]
        if kind == b"IHDR":
            ihdr = struct.unpack(">IIBBBBB", body)
        elif kind == b"IDAT":
            idat += body
        pos += 12 + length
    width, height, depth, color = ihdr[:4]
    if depth != 8 or color not in (2, 6):
        fail(f"{path}: PNG colour type {color} depth {depth} not handled")
    bpp = 3 if color == 2 else 4
    raw = zlib.decompress(idat)
    stride = width * bpp
    rows, prev = [], bytearray(stride)
    for y in range(height):
        f = raw[y * (stride + 1)]
        line = bytearray(raw[y * (stride + 1) + 1:(y + 1) * (stride + 1)])
        for i in range(stride):
            a = line[i - bpp] if i >= bpp else 0
            b = prev[i]
            c = prev[i - bpp] if i >= bpp else 0
            if f == 1:
                line[i] = (line[i] + a) & 255
            elif f == 2:
                line[i] = (line[i] + b) & 255
            elif f == 3:
                line[i] = (line[i] + (a + b) // 2) & 255
            elif f == 4:
                p = a + b - c
                pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
                line[i] = (line[i] + (a if pa <= pb and pa <= pc else b if pb <= pc else c)) & 255
        rows.append(bytes(line))
        prev = line
    return width, height, bpp, rows


def check_screenshot(path):
    width, height, bpp, rows = png_pixels(path)
    if (width, height) != WINDOW:
        fail(f"{path}: {width}x{height}, expected {WINDOW}")
    counts = {}
    for row in rows[::4]:
        for x in range(0, width * bpp, bpp * 4):
            px = row[x:x + 3]
            counts[px] = counts.get(px, 0) + 1
    total = sum(counts.values())
    top = max(counts.values())
    if len(counts) < 50 or top > 0.97 * total:
        fail(f"{path} looks blank: {len(counts)} colours, the commonest covers "
             f"{100 * top / total:.1f}%")
    return len(counts), 100 * top / total


def chromium(browser, args, log):
    argv = [browser, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
            "--hide-scrollbars",
            "--host-resolver-rules=MAP * ~NOTFOUND", f"--window-size={WINDOW[0]},{WINDOW[1]}",
            *args]
    p = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    open(log, "w").write(p.stderr)
    if p.returncode != 0:
        print(p.stderr[-3000:])
        fail(f"{' '.join(argv)} exited with {p.returncode}")
    return p.stdout


def check_page(browser, ft, run_dir, steps, resumed, work, name):
    page = os.path.join(work, f"{name}.html")
    rc, text = run([ft, "report", run_dir, "--output", page], os.path.join(work, f"{name}-report.log"))
    if rc != 0:
        print(text)
        fail(f"ft report {run_dir} exited with {rc}")
    html = open(page, encoding="utf-8").read()
    for bad in ("http://", "https://", "src=", "<script", "url(", "@import", "<link"):
        if bad in html:
            fail(f"{page} contains {bad!r}: the page must load nothing")
    shot = os.path.join(work, f"{name}.png")
    chromium(browser, [f"--screenshot={shot}", "file://" + page], os.path.join(work, f"{name}-shot.log"))
    colours, top = check_screenshot(shot)
    dom = chromium(browser, ["--dump-dom", "file://" + page], os.path.join(work, f"{name}-dom.log"))
    if "<svg" not in dom:
        fail(f"Chromium's DOM of {page} has no SVG")
    want = {"loss": steps, "loss_smoothed": steps, "lr": steps, "grad_norm": steps,
            "tokens_per_s": steps, "mfu": steps, "time.compute_s": steps, "time.comm_s": steps,
            "time.data_s": steps, "time.optimizer_s": steps, "time.checkpoint_s": steps,
            "rank_busy": 2 * steps, "memory.peak": 2, "timeline.finished": 1,
            "timeline.start / resume": 2 if resumed else 1, "timeline.preempted": 1 if resumed else 0}
    for series, n in want.items():
        m = re.search(r'data-series="%s" data-points="(\d+)"' % re.escape(series), dom)
        if not m or int(m.group(1)) != n:
            fail(f"{name}: series {series!r} has {m.group(1) if m else 'no element'} points in "
                 f"Chromium's DOM, expected {n}")
    poly = re.search(r'<polyline data-series="loss" [^>]*points="([^"]*)"', dom)
    if not poly or len(poly.group(1).split()) != steps:
        fail(f"{name}: the loss polyline does not have {steps} points")
    charts = re.findall(r'data-chart="([^"]+)"', dom)
    for c in ("loss", "lr", "grad_norm", "tokens_per_s", "mfu", "step_time", "memory",
              "rank_heat_map", "timeline"):
        if c not in charts:
            fail(f"{name}: no {c!r} figure in Chromium's DOM (found {charts})")
    print(f"ok: {name}: {len(charts)} figures, {steps} steps drawn, screenshot {colours} colours "
          f"(commonest {top:.0f}%)")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ft", required=True)
    ap.add_argument("--keep", help="keep the runs, pages and screenshots in this directory")
    ap.add_argument("--steps", type=int, default=10, help="steps of the finished run")
    args = ap.parse_args()
    browser = find_chromium()
    if not browser:
        print(f"{'FAIL' if CI else 'SKIP'}: no chromium on PATH (scripts/setup.sh installs Debian's "
              f"chromium; or set CHROMIUM)")
        sys.exit(1 if CI else SKIP)
    # A browser that is installed but cannot start here (no shared memory, missing libraries).
    try:
        probe = subprocess.run([browser, "--headless", "--no-sandbox", "--disable-gpu",
                                "--disable-dev-shm-usage", "--dump-dom", "about:blank"],
                               capture_output=True, text=True, timeout=60)
        ok, why = probe.returncode == 0, probe.stderr.strip()[-300:]
    except (OSError, subprocess.TimeoutExpired) as e:
        ok, why = False, str(e)
    if not ok:
        print(f"{'FAIL' if CI else 'SKIP'}: {browser} cannot run headless here: {why}")
        sys.exit(1 if CI else SKIP)
    work = args.keep or tempfile.mkdtemp(prefix="ft-browser-")
    os.makedirs(work, exist_ok=True)
    out, steps = finished_run(args.ft, work, args.steps)
    check_page(browser, args.ft, out, steps, False, work, "finished")
    out, steps = resumed_run(args.ft, work)
    check_page(browser, args.ft, out, steps, True, work, "resumed")
    print("PASS: Chromium rendered both reports")
    if not args.keep:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
