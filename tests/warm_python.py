"""A `python` for scripts under test that start many Python commands: each command runs in a
process forked from one interpreter that imported the heavy modules (torch, transformers) once,
instead of importing them again (~5 s each on the 2-core CPU).

    with warm_python(["torch", "transformers"], cwd=root, env=env) as py:
        subprocess.run(["bash", script], env={**env, "PYTHON": py})

`py` is a command line (`python CLIENT`) that takes `-m MODULE ARGS` or `-c CODE ARGS` like python.
The client hands its argv, working directory, environment and standard streams to the server,
which forks; the child runs the command as `python` would (runpy for -m, exec for -c) and its exit
status comes back as the client's. The server must only import modules, never run torch ops, so
that forking it is safe (no thread pools yet)."""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import textwrap
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

_SERVER = textwrap.dedent("""
    import json, os, runpy, socket, sys, traceback
    path = sys.argv[1]
    for name in sys.argv[2:]:
        __import__(name)
    srv = socket.socket(socket.AF_UNIX)
    srv.bind(path)
    srv.listen(16)
    print("ready", flush=True)

    def run(argv):
        if argv[:1] == ["-m"]:
            sys.argv = [argv[1], *argv[2:]]
            sys.path.insert(0, os.getcwd())
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        elif argv[:1] == ["-c"]:
            sys.argv = ["-c", *argv[2:]]
            sys.path.insert(0, "")
            exec(compile(argv[1], "<string>", "exec"), {"__name__": "__main__"})
        else:
            raise SystemExit(f"warm python takes -m MODULE or -c CODE, not {argv[:1]}")

    while True:
        conn, _ = srv.accept()
        msg, fds, _, _ = socket.recv_fds(conn, 1 << 20, 3)
        request = json.loads(msg)
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            srv.close()
            code = 0
            try:
                for i, fd in enumerate(fds):
                    os.dup2(fd, i)
                    os.close(fd)
                os.chdir(request["cwd"])
                os.environ.clear()
                os.environ.update(request["env"])
                if request["env"].get("PYTHONUNBUFFERED"):
                    sys.stdout.reconfigure(line_buffering=True)
                    sys.stderr.reconfigure(line_buffering=True)
                run(request["argv"])
            except SystemExit as e:
                code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
                if not isinstance(e.code, int) and e.code is not None:
                    print(e.code, file=sys.stderr)
            except BaseException:
                traceback.print_exc()
                code = 1
            try:
                sys.stdout.flush()
                sys.stderr.flush()
            finally:
                os._exit(code)
        for fd in fds:
            os.close(fd)
        _, status = os.waitpid(pid, 0)
        conn.sendall(str(os.waitstatus_to_exitcode(status)).encode())
        conn.close()
""")

_CLIENT = textwrap.dedent("""
    import json, os, socket, sys
    s = socket.socket(socket.AF_UNIX)
    s.connect({path!r})
    msg = json.dumps({{"argv": sys.argv[1:], "cwd": os.getcwd(), "env": dict(os.environ)}}).encode()
    socket.send_fds(s, [msg], [0, 1, 2])
    answer = s.recv(64)
    sys.exit(int(answer) if answer else 1)
""")


@contextmanager
def warm_python(preload: list[str], cwd: Path, env: dict[str, str]) -> Iterator[str]:
    folder = Path(tempfile.mkdtemp(prefix="warm-python-"))
    sock = str(folder / "s")
    client = folder / "client.py"
    client.write_text(_CLIENT.format(path=sock))
    server = subprocess.Popen([sys.executable, "-c", _SERVER, sock, *preload], cwd=cwd, env=env,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert server.stdout.readline().strip() == "ready", "the warm python did not start"
        yield f"{sys.executable} {client}"
    finally:
        server.kill()           # it holds nothing to save: an exit would only tear torch down
        server.wait()
        for f in folder.iterdir():
            f.unlink()
        os.rmdir(folder)
