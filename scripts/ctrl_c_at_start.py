"""Ctrl-C during ``shardload load``'s start: SIGINT at a random 0.1-1.2 s, TRIES times; every
run must end 130. Prints each other exit code with the last lines of its stderr.

    PYTHONPATH=. python scripts/ctrl_c_at_start.py [CKPT] [TRIES]
"""

import os
import random
import signal
import subprocess
import sys
import time

ckpt = sys.argv[1] if len(sys.argv) > 1 else "examples/tiny_llama_q4"
tries = int(sys.argv[2]) if len(sys.argv) > 2 else 30
rng = random.Random(int(os.environ.get("SEED", "0")))
codes, odd = {}, []
for k in range(tries):
    delay = rng.uniform(0.1, 1.2)
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "shardload",
            "load",
            "--shards",
            "4",
            "--session",
            "thread",
            "--quiet",
            ckpt,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        # a background shell's children start with SIGINT ignored
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    time.sleep(delay)
    proc.send_signal(signal.SIGINT)
    stdout, stderr = proc.communicate(timeout=120)
    code = proc.returncode
    codes[code] = codes.get(code, 0) + 1
    if code != 130 or "Exception ignored" in stderr or "Traceback" in stderr:
        odd.append((k, round(delay, 2), code, stderr.strip().splitlines()[-3:]))
print(f"{tries} tries on {ckpt}: exit codes {dict(sorted(codes.items()))}")
for k, delay, code, tail in odd:
    print(f"  try {k} at {delay} s: exit {code}: {tail}")
sys.exit(0 if not odd else 1)
