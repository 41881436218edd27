"""How the apps start and fail: `run(main, help_groups, doc)` instead of absl's `app.run`.

`--help` lists the app's own flags in groups (`--helpfull` keeps absl's full list). An error in the user's input (a
bad flag, config, checkpoint, capacity, mesh or budget: jaxkv.preflight.InputError, absl's UsageError and flag errors)
prints one line, and a hint line where one helps, with no traceback: exit status 2 for usage errors, 1 for runtime
failures. Ctrl-C prints "interrupted" and exits with status 130 at once. Programming errors keep their traceback.
"""

from __future__ import annotations

import json
import os
import re
import signal
import sys
import textwrap

from absl import app
from absl import flags
from absl import logging

from jaxkv import preflight

USAGE = preflight.USAGE
INTERRUPTED = 130  # Exit status after Ctrl-C (128 + SIGINT), as a shell reports it.


def run(main, help_groups: dict[str, list], doc: str, parse=None, shown: dict[str, str] | None = None) -> None:
  """absl's app.run(main) with jaxkv's --help (`doc`'s first paragraph, then the flags of `help_groups`, {group
  title: [flag holders]}, with the defaults of `shown`, {flag name: default}, where the flag's own is not the one that
  applies), one-line input errors and Ctrl-C (module docstring). parse(argv) parses the flags (default
  flags.FLAGS(argv)); a flag error is one line either way."""

  def parse_flags(argv):
    if any(a in ("--help", "-h", "-?", "--helpshort") for a in argv[1:]):
      print(help_text(doc, help_groups, shown or {}))
      sys.exit(0)
    try:
      return (parse or flags.FLAGS)(argv)
    except flags.Error as e:
      fail(flag_error(str(e)), f"{prog()} --help lists the flags")

  def guarded(argv):
    try:
      return main(argv)
    except preflight.InputError as e:
      fail(str(e), e.hint, e.status)
    except (app.UsageError, flags.Error) as e:
      fail(str(e))
    except KeyboardInterrupt:
      interrupt()

  signal.signal(signal.SIGINT, interrupt)
  app.run(guarded, flags_parser=parse_flags)


def check_outputs(*holders) -> None:
  """Each output path flag that is set names a file (not a folder) in an existing folder (checked before any
  work)."""
  for h in holders:
    if h.value:
      folder = os.path.dirname(os.path.abspath(h.value))
      if os.path.isdir(h.value):
        raise preflight.InputError(f"--{h.name}={h.value} is a folder", "give a file name in it")
      if not os.path.isdir(folder):
        raise preflight.InputError(f"--{h.name}={h.value}: the folder {folder} does not exist", "create it first")
      if not os.access(folder, os.W_OK):
        raise preflight.InputError(f"--{h.name}={h.value}: the folder {folder} is not writable", "write elsewhere")


def write_json(obj: dict, path: str | None) -> None:
  """Writes an app's JSON output where --json_out says (nothing when it is unset)."""
  if path:
    with open(path, "w") as f:
      json.dump(obj, f, indent=1)
    logging.info("wrote %s", path)


def interrupt(*_) -> None:
  """Ctrl-C: one line and exit status 130, at once (a KeyboardInterrupt raised inside JAX's callbacks or threads
  could be swallowed there, and a generation's threads would keep the process alive)."""
  try:
    sys.stdout.flush()
  except (OSError, RuntimeError, ValueError):  # A reentrant call (the signal interrupted a print), a closed pipe.
    pass
  # At the start of its own line, over a progress bar's (on a terminal, erasing the rest of it).
  os.write(2, b"\rinterrupted\x1b[K\n" if os.isatty(2) else b"\rinterrupted\n")
  os._exit(INTERRUPTED)


def fail(message: str, hint: str | None = None, status: int = USAGE):
  """Prints `python3 -m <app>: error: <message>` (and the hint) on stderr and exits with `status`."""
  print(f"{prog()}: error: {' '.join(message.split())}", file=sys.stderr)
  if hint:
    print(f"  hint: {hint}", file=sys.stderr)
  sys.exit(status)


def flag_error(message: str) -> str:
  """A flag error's message, without the traceback that a config file's own exception carries in it."""
  if "Traceback (most recent call last)" not in message:
    return message
  head = message.split("Error whilst parsing config file")[0].rstrip(": ")
  last = re.sub(r"^[\w.]*(Error|Exception): ", "", [l for l in message.splitlines() if l.strip()][-1])
  return f"{head}: {last}"


def prog() -> str:
  """The command that runs this app: python3 -m <its module>."""
  spec = getattr(sys.modules["__main__"], "__spec__", None)  # A package's app is its __main__ module.
  return f"python3 -m {spec.name.removesuffix('.__main__') if spec else os.path.basename(sys.argv[0])}"


def help_text(doc: str, groups: dict[str, list], shown: dict[str, str]) -> str:
  """--help: the app's first docstring paragraph, then each group's flags with default and help."""
  lines = [f"usage: {prog()} [--flag=value ...]", "", doc.strip().split("\n\n")[0], ""]
  for title, holders in groups.items():
    lines.append(f"{title}:")
    for h in holders:
      f = flags.FLAGS[h.name]
      default = shown.get(f.name) or (f.default_as_str.strip("'") if f.default is not None else "")
      text = f.help
      choices = re.match(r"<([^>]*)>: ", text)  # An enum's choices, and a shorthand's field: on the flag's line.
      text = text[choices.end() :] if choices else text
      field = re.match(r"(config [\w.]+): ", text)
      text = text[field.end() :] if field else text
      line = f"  --{f.name}" + (f"={default}" if default else "") + (f" <{choices.group(1)}>" if choices else "")
      lines.append(line + (f"  ({field.group(1)})" if field else ""))
      lines += textwrap.wrap(" ".join(text.split()), 112, initial_indent=" " * 6, subsequent_indent=" " * 6)
    lines.append("")
  lines.append("--helpfull lists every flag, absl's logging flags too.")
  return "\n".join(lines)
