"""A command for tests/integration/test_forkserver.py: ``python -m tests.forkprobe CODE``
prints what a started process sees, then exits with CODE (``wait``: blocks until a
signal ends it)."""

import json
import os
import signal
import sys

if __name__ == "__main__":
    seen = {
        "argv": sys.argv[1:],
        "program": os.path.basename(sys.argv[0]),
        "probe_env": os.environ.get("FORKPROBE"),
        "session_leader": os.getsid(0) == os.getpid(),
        "cwd": os.getcwd(),
        "stdin": sys.stdin.read(),
        "netns": os.readlink("/proc/self/ns/net"),
        "sigint": "python"
        if signal.getsignal(signal.SIGINT) is signal.default_int_handler
        else "?",
    }
    print(json.dumps(seen), flush=True)
    print("to stderr", file=sys.stderr, flush=True)
    if sys.argv[1] == "wait":
        while True:
            signal.pause()
    sys.exit(int(sys.argv[1]))
