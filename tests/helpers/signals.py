"""A worker that counts the scheduler notices it receives, for the signal tests (tests/test_signals.py and the
real-Slurm ones): it counts SIGUSR1/SIGUSR2 from the moment its handlers are installed (then it writes ready.RANK),
and at the file "done" writes what it got to got.RANK and exits 0. A signal it has no handler for would kill it. Both
files appear whole (written aside, then renamed): a test that sees one may read it at once."""

WORKER = """\
import os, pathlib, signal, sys, time
folder, rank = pathlib.Path(sys.argv[1]), os.environ["RANK"]
def write(name, text):
    (folder / f".{name}").write_text(text)
    os.replace(folder / f".{name}", folder / name)
got = []
for signum in (signal.SIGUSR1, signal.SIGUSR2):
    signal.signal(signum, lambda s, frame: got.append(signal.Signals(s).name))
write(f"ready.{rank}", str(os.getpid()))
while not (folder / "done").exists():
    time.sleep(0.02)
write(f"got.{rank}", ",".join(got))
"""
