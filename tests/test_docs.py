"""docs/reference.md's flag tables against the code: a default that drifts fails here."""

import pathlib
import re

from jaxkv import cli

from experiments import common

REFERENCE = (pathlib.Path(__file__).parent.parent / "docs" / "reference.md").read_text()


def _same(shown: str, code) -> bool:
  """The table's default `shown` is the code's value (numbers compared as numbers: `0` for 0.0)."""
  if isinstance(code, (int, float)) and not isinstance(code, bool):
    return float(shown) == code
  return shown == str(code)


def test_every_kv_shorthand_row_names_its_field_and_the_config_default():
  rows = re.findall(r"^\| `--(kv_\w+)` \| config `kv\.(\w+)` \(([^)]*)\)", REFERENCE, re.M)
  assert len(rows) >= 10, rows
  base = common.base_config().kv
  for flag, field, default in rows:
    assert cli._KV_FLAGS[field].name == flag, (flag, field)  # pylint: disable=protected-access
    code = base[field]
    shown = re.match(r"`([^`]*)`", default)
    if code is None:
      assert shown is None and default == "none", (flag, default)
    else:
      assert shown is not None and _same(shown.group(1), code), (flag, default, code)
  assert {field for _, field, _ in rows} == set(cli._KV_FLAGS)  # pylint: disable=protected-access


def test_every_config_override_row_shows_the_config_default():
  rows = re.findall(r"^\| `--config\.(\w+)\.(\w+)` \| `([^`]*)`", REFERENCE, re.M)
  assert rows
  base = common.base_config()
  for section, field, default in rows:
    assert _same(default, base[section][field]), (section, field, default)
