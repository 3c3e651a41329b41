"""smc-run's launcher: parse its options, put the bootstrap on ``PYTHONPATH`` and exec the program.

Kept apart from :mod:`smc_handoff.run` (what the program's interpreter loads to upgrade its
sockets) and importing nothing of the library, nor ``pathlib`` or ``shutil``: every program started
under smc-run pays for a second interpreter here, so this one only reads its arguments and execs.
The console script's interpreter still runs ``site`` (~25 ms here: ``.pth`` files); this module
also runs as a script without it, ``python -I -S .../smc_handoff/launch.py ARGS`` (~8 ms), which
is what a faster ``smc-run`` would exec (``-I``: not its own directory on ``sys.path``, where
``socket.py`` is the library's).
"""

from __future__ import annotations

import os
import sys

TYPE_CHECKING = False
if TYPE_CHECKING:
    from pathlib import Path

    BOOT_DIR: Path

__all__ = [
    "BOOT_DIR",
    "ENV_ACTIVE",
    "ENV_DEBUG",
    "ENV_VERBOSE",
    "HELP",
    "USAGE",
    "command_line",
    "main",
]

_BOOT_DIR = os.path.join(os.path.dirname(os.path.realpath(__file__)), "_boot")
# (BOOT_DIR, a Path, comes from __getattr__: pathlib costs every program under smc-run ~3 ms)
ENV_ACTIVE = "SMC_RUN"
ENV_DEBUG = "SMC_RUN_DEBUG"
ENV_VERBOSE = "SMC_RUN_VERBOSE"

USAGE = """\
usage: smc-run [-d] [-v] PROGRAM [ARG...]
       smc-run [-d] [-v] -m MODULE [ARG...]
       smc-run [-d] [-v] -c COMMAND [ARG...]
"""

HELP = (
    USAGE
    + """
Run a Python program with its TCP stream sockets upgraded to SMC through smcd, on both the
client side (connect) and the server side (listen/accept), like smc-tools' smc_run.

  PROGRAM       a Python script, or a command that starts Python (python3, a console
                script...); child Python processes are upgraded too
  -m MODULE     run a library module as a script (python -m MODULE)
  -c COMMAND    run a Python command string (python -c COMMAND)
  -d, --debug   log every handoff step of the smc_handoff library to stderr
  -v, --verbose print one line per connection to stderr: its mode (smcd, smcr or tcp) and,
                on tcp, the fallback reason (the line comes at the connection's first use
                after connect() or accept(), when smcd's answer is read)
  -h, --help    show this help and exit

Without a running smcd the program runs unchanged on plain TCP. asyncio programs are upgraded
too (asyncio's own event loop; not uvloop), TLS included, and trio programs. Environment:
SMCD_HANDOFF_SOCKET (the daemon's handoff socket), SMCD_HANDOFF_TIMEOUT (seconds to wait for
the daemon's answer), SMC_RUN_DMB_SIZE (the receive buffer an asyncio connection asks for,
bytes; default: the daemon's), SMC_RUN_BUSY_POLL=0 (an event loop does not spin on its SMC
connections before it sleeps; default: it spins briefly, as SO_BUSY_POLL does).
"""
)


def __getattr__(name: str) -> Path:
    """``BOOT_DIR``: the bootstrap's directory (a :class:`~pathlib.Path`), made on first use."""
    if name != "BOOT_DIR":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from pathlib import Path

    return Path(_BOOT_DIR)


def _is_python_script(path: str) -> bool:
    if path.endswith((".py", ".pyw")):
        return True
    try:
        with open(path, "rb") as f:
            first = f.readline(256)
    except OSError:
        return False
    return first.startswith(b"#!") and b"python" in first and not os.access(path, os.X_OK)


def _on_path(program: str) -> bool:
    """``shutil.which(program) is not None``, without ``shutil`` (with ``fnmatch`` and ``re``
    behind it: ~5 ms of a launcher that runs without ``site``)."""

    def runnable(path: str) -> bool:
        return (
            os.path.exists(path) and os.access(path, os.F_OK | os.X_OK) and not os.path.isdir(path)
        )

    if os.path.dirname(program):
        return runnable(program)
    path = os.environ.get("PATH")
    if path is None:
        try:
            path = os.confstr("CS_PATH")
        except (AttributeError, ValueError):
            path = os.defpath
    if not path:
        return False
    return any(runnable(os.path.join(d, program)) for d in path.split(os.pathsep))


def command_line(argv: list[str]) -> tuple[list[str], bool, bool] | str:
    """Parse smc-run's own options: (the command to exec, verbose, debug) or an error text."""
    verbose = debug = False
    args = list(argv)
    while args and args[0].startswith("-"):
        opt = args.pop(0)
        if opt == "--":
            break
        if opt in ("-v", "--verbose"):
            verbose = True
        elif opt in ("-d", "--debug"):
            debug = True
        elif opt in ("-h", "--help"):
            return "help"
        elif opt in ("-m", "-c"):
            if not args:
                return f"smc-run: {opt} needs an argument"
            return [sys.executable, opt, *args], verbose, debug
        elif opt.startswith(("-m", "-c")) and len(opt) > 2:  # -mhttp.server, as python allows
            return [sys.executable, opt[:2], opt[2:], *args], verbose, debug
        elif len(opt) > 2 and not opt.startswith("--") and set(opt[1:]) <= {"v", "d"}:
            verbose = verbose or "v" in opt
            debug = debug or "d" in opt
        else:
            return f"smc-run: unknown option {opt}"
    if not args:
        return "smc-run: no program given"
    program = args[0]
    if os.path.isfile(program) and _is_python_script(program):
        return [sys.executable, *args], verbose, debug
    if not _on_path(program):
        return f"smc-run: {program}: command not found"
    return args, verbose, debug


def main(argv: list[str] | None = None) -> int:
    parsed = command_line(sys.argv[1:] if argv is None else argv)
    if parsed == "help":
        sys.stdout.write(HELP)
        return 0
    if isinstance(parsed, str):
        sys.stderr.write(f"{parsed}\n{USAGE}")
        return 2
    command, verbose, debug = parsed
    env = dict(os.environ)
    env[ENV_ACTIVE] = "1"
    env[ENV_VERBOSE] = "1" if verbose else "0"
    env[ENV_DEBUG] = "1" if debug else "0"
    env["PYTHONPATH"] = os.pathsep.join(p for p in (_BOOT_DIR, env.get("PYTHONPATH", "")) if p)
    if debug:
        try:
            from smc_handoff.messages import handoff_socket_candidates
        except ImportError:  # run as a script without site (python -I -S .../launch.py)
            sys.path.insert(0, os.path.dirname(os.path.dirname(_BOOT_DIR)))
            from smc_handoff.messages import handoff_socket_candidates

        where = handoff_socket_candidates(env)
        print(
            f"smc-run: exec {command} (handoff socket: {', '.join(map(str, where))})",
            file=sys.stderr,
        )
    sys.stdout.flush()
    try:
        os.execvpe(command[0], command, env)
    except OSError as e:
        print(f"smc-run: {command[0]}: {e.strerror}", file=sys.stderr)
        return 127
    return 0  # not reached


if __name__ == "__main__":
    raise SystemExit(main())
