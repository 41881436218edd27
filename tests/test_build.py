"""BUILD covers the tree: a py_library per module, a py_test per test file, deps that match the imports.

BUILD is Starlark, and this one is also Python: it is evaluated with its rules recorded instead of run. The checks
take the repository root as an argument, so the last tests run them on a copy with a module added.
"""

from __future__ import annotations

import ast
import pathlib
import shutil

import pytest

ROOT = pathlib.Path(__file__).absolute().parent.parent  # Not resolved: under Bazel, the runfiles tree.
LIBRARY_DIRS = ("jaxkv", "experiments")
TESTS = "tests"
PYTEST_MAIN = "tools/pytest_main.py"
DEVICE_FLAG = "--xla_force_host_platform_device_count="
CONFTEST = "tests/conftest.py"


def _experiments(root: pathlib.Path) -> set[str]:
  return {p.relative_to(root).as_posix() for p in (root / "experiments").glob("*.py")} - {
      "experiments/__init__.py",
      "experiments/common.py",
  }


# Deps that no import statement shows, from the repository root: experiments/tiny.py is jaxkv/apps/cli.py's default
# --config file, loaded by path; tests/test_experiments.py imports every experiment by name; tests run the apps
# (serve_bench starts serve) as `python -m` without importing them (an app's flags would clash with another's in one
# process).
NON_IMPORT_DEPS = {
    "jaxkv/apps/cli.py": lambda root: {"experiments/tiny.py"},
    "tests/test_experiments.py": _experiments,
    "tests/test_bench.py": lambda root: {"jaxkv/bench/__main__.py"},
    "tests/test_gates.py": lambda root: {"jaxkv/gates.py"},
    "tests/test_serve_bench.py": lambda root: {"jaxkv/serve_bench.py", "jaxkv/serve.py"},
    "tests/test_compile_cache.py": lambda root: {"jaxkv/generate.py"},
    "tests/test_gguf.py": lambda root: {"jaxkv/generate.py"},
    "tests/test_serve_gguf.py": lambda root: {"jaxkv/generate.py", "jaxkv/serve.py"},
    "tests/test_errors.py": lambda root: {
        "jaxkv/generate.py",
        "jaxkv/gates.py",
        "jaxkv/serve.py",
        "jaxkv/serve_bench.py",
        "jaxkv/bench/__main__.py",
    },
}
# Tests that load a script of tools/ by path (a data file): the script's imports are the test's deps too.
RUN_BY_PATH = {
    "tests/test_host_attention.py": "tools/probe_host_attention.py",
    "tests/test_host_attention_engine.py": "tools/probe_held_merge.py",
    "tests/test_gguf.py": "tools/kv_quality.py",
}


def load_build(root: pathlib.Path) -> dict[str, dict]:
  """Evaluates root/BUILD; returns {target name: attributes, plus "kind"}."""
  targets: dict[str, dict] = {}

  def rule(kind):
    def record(name, **attrs):
      if name in targets:
        raise ValueError(f"BUILD declares {name!r} twice")
      targets[name] = dict(attrs, kind=kind)

    return record

  def glob(include, exclude=()):
    found = {p.relative_to(root).as_posix() for pattern in include for p in root.glob(pattern)}
    return sorted(found - {p.relative_to(root).as_posix() for pattern in exclude for p in root.glob(pattern)})

  namespace = {"__builtins__": {}, "glob": glob}
  namespace.update({kind: rule(kind) for kind in ("py_library", "py_test", "py_binary")})
  exec(compile((root / "BUILD").read_text(), str(root / "BUILD"), "exec"), namespace)  # pylint: disable=exec-used
  return targets


def modules(root: pathlib.Path) -> list[str]:
  """Every module that needs a py_library: those of jaxkv/ and experiments/ (subpackages too) and the non-test files
  of tests/."""
  paths = [p for d in LIBRARY_DIRS for p in sorted((root / d).rglob("*.py"))]
  paths += [p for p in sorted((root / TESTS).glob("*.py")) if not p.name.startswith("test_")]
  return [p.relative_to(root).as_posix() for p in paths]


def pytest_files(root: pathlib.Path) -> list[str]:
  return [p.relative_to(root).as_posix() for p in sorted((root / TESTS).glob("test_*.py"))]


def first_party_imports(root: pathlib.Path, path: str) -> set[str]:
  """Repo paths of the first-party modules that `path` imports (anywhere in it, deferred imports included).

  A package's __init__.py counts only when a name is imported from the package itself: every module imports
  its parent package, and jaxkv/__init__.py imports most of jaxkv, so as a dep it would make cycles.
  """

  def resolve(dotted: str) -> str | None:
    parts = dotted.split(".")
    if parts[0] in LIBRARY_DIRS:
      base = root.joinpath(*parts)
    elif path.startswith(f"{TESTS}/") and len(parts) == 1:  # pytest puts tests/ on sys.path.
      base = root / TESTS / parts[0]
    else:
      return None
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
      if candidate.is_file():
        return candidate.relative_to(root).as_posix()
    return None

  found = set()
  for node in ast.walk(ast.parse((root / path).read_text(), path)):
    if isinstance(node, ast.Import):
      found.update(resolve(alias.name) for alias in node.names)
    elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
      found.update(resolve(f"{node.module}.{a.name}") or resolve(node.module) for a in node.names)
  return found - {None, path}


def owners(targets: dict[str, dict]) -> dict[str, list[str]]:
  """Source path -> names of the targets whose srcs list it (the pytest main excluded)."""
  out: dict[str, list[str]] = {}
  for name, t in targets.items():
    for src in t.get("srcs", []):
      if src != PYTEST_MAIN:
        out.setdefault(src, []).append(name)
  return out


def label_name(label: str) -> str | None:
  """The target name of a label in this package (":x" or "//:x"), else None."""
  for prefix in (":", "//:"):
    if label.startswith(prefix) and ":" not in label[len(prefix) :]:
      return label[len(prefix) :]
  return None


def suggested_name(path: str) -> str:
  """tests/test_x.py -> test_x; jaxkv/bench/report.py -> jaxkv_bench_report; a package's __init__.py is the package,
  its __main__.py "main" (jaxkv/bench/__main__.py -> jaxkv_bench_main)."""
  p = pathlib.PurePosixPath(path)
  if p.parent.name == TESTS and p.name.startswith("test_"):
    return p.stem
  parts = list(p.parent.parts) + ([] if p.name == "__init__.py" else [p.stem.strip("_")])
  return "_".join(parts)


def expected_dep_paths(root: pathlib.Path, target: dict) -> set[str]:
  srcs = [s for s in target.get("srcs", []) if s != PYTEST_MAIN]
  deps = set()
  for src in srcs + [RUN_BY_PATH[s] for s in srcs if s in RUN_BY_PATH]:
    deps |= first_party_imports(root, src) | NON_IMPORT_DEPS.get(src, lambda _: set())(root)
  if target["kind"] == "py_test" and (root / CONFTEST).is_file():
    deps.add(CONFTEST)  # pytest loads it into every test of tests/.
  return deps - set(srcs)


def suggestion(root: pathlib.Path, kind: str, path: str, by_path: dict[str, list[str]]) -> str:
  deps = sorted(
      f":{by_path.get(d, [suggested_name(d)])[0]}" for d in expected_dep_paths(root, {"kind": kind, "srcs": [path]})
  )
  lines = [f"{kind}(", f'    name = "{suggested_name(path)}",']
  if kind == "py_test":
    lines += [f'    srcs = ["{path}", PYTEST_MAIN],', "    main = PYTEST_MAIN,", f'    args = ["{path}"],']
    lines += ['    data = ["pyproject.toml"],']
  else:
    lines += [f'    srcs = ["{path}"],']
  lines += ["    deps = [" + ", ".join(f'"{d}"' for d in deps) + "],", ")"]
  return "\n".join(lines)


def missing_targets(root: pathlib.Path) -> list[str]:
  """Modules without exactly one py_library, test files without exactly one py_test (with a suggested rule)."""
  targets = load_build(root)
  by_path = owners(targets)
  problems = []
  for kind, paths in (("py_library", modules(root)), ("py_test", pytest_files(root))):
    for path in paths:
      names = [n for n in by_path.get(path, []) if targets[n]["kind"] == kind]
      if len(names) != 1:
        problems.append(
            f"{path}: {len(names)} {kind} targets {names}; add to BUILD:\n{suggestion(root, kind, path, by_path)}"
        )
  return problems


def dangling_deps(root: pathlib.Path) -> list[str]:
  """deps labels that are not targets declared in BUILD."""
  targets = load_build(root)
  return [
      f"{name}: dep {label!r} is not a target in BUILD"
      for name, t in targets.items()
      for label in t.get("deps", [])
      if label_name(label) not in targets
  ]


def missing_files(root: pathlib.Path) -> list[str]:
  targets = load_build(root)
  return [
      f"{name}: {attr} {f!r} does not exist"
      for name, t in targets.items()
      for attr in ("srcs", "data")
      for f in t.get(attr, [])
      if not (root / f).is_file()
  ]


def wrong_deps(root: pathlib.Path) -> list[str]:
  """Targets whose deps differ from what their sources import, or list one twice."""
  targets = load_build(root)
  by_path = owners(targets)
  problems = []
  for name, t in sorted(targets.items()):
    want = {n for path in expected_dep_paths(root, t) for n in by_path.get(path, [f"<no target for {path}>"])}
    deps = [label_name(label) for label in t.get("deps", [])]
    have = set(deps)
    if want != have:
      problems.append(f"{name}: missing deps {sorted(want - have)}, unused deps {sorted(have - want)}")
    if len(deps) != len(have):  # Bazel refuses to load the package.
      problems.append(f"{name}: deps listed twice {sorted(d for d in have if deps.count(d) > 1)}")
  return problems


def misconfigured_tests(root: pathlib.Path) -> list[str]:
  """py_tests must run their file through the pytest main; those that reach jaxkv must set the device count."""
  targets = load_build(root)

  def reaches_jaxkv(name, seen=()):
    t = targets[name]
    if any(s.startswith("jaxkv/") for s in t.get("srcs", [])):
      return True
    deps = [label_name(label) for label in t.get("deps", [])]
    return any(d in targets and d not in seen and reaches_jaxkv(d, (*seen, name)) for d in deps)

  problems = []
  for name, t in sorted(targets.items()):
    if t["kind"] != "py_test":
      continue
    files = [s for s in t.get("srcs", []) if s != PYTEST_MAIN]
    if t.get("main") != PYTEST_MAIN or PYTEST_MAIN not in t.get("srcs", []) or t.get("args") != files:
      problems.append(f"{name}: needs srcs = [<test file>, PYTEST_MAIN], main = PYTEST_MAIN, args = [<test file>]")
    if reaches_jaxkv(name) and DEVICE_FLAG not in t.get("env", {}).get("XLA_FLAGS", ""):
      problems.append(f"{name}: runs jaxkv but its env does not set XLA_FLAGS={DEVICE_FLAG}N")
  return problems


def unseen_by_test_build(root: pathlib.Path) -> list[str]:
  """Modules and test files that test_build's own runfiles lack: under Bazel these checks read only those files, and
  conftest imports jaxkv from them."""
  target = load_build(root).get("test_build", {})
  seen = set(target.get("srcs", [])) | set(target.get("data", []))
  return [f"test_build: data does not cover {path}" for path in modules(root) + pytest_files(root) if path not in seen]


CHECKS = (missing_targets, dangling_deps, missing_files, wrong_deps, misconfigured_tests, unseen_by_test_build)


@pytest.mark.parametrize("check", CHECKS, ids=lambda c: c.__name__)
def test_build_matches_the_tree(check):
  problems = check(ROOT)
  assert not problems, "\n".join(problems)


@pytest.fixture
def tree_copy(tmp_path):
  """The files the checks read, copied."""
  for rel in ["BUILD", "pyproject.toml", PYTEST_MAIN, *modules(ROOT), *pytest_files(ROOT), *RUN_BY_PATH.values()]:
    if (ROOT / rel).is_file():
      (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
      shutil.copyfile(ROOT / rel, tmp_path / rel)
  return tmp_path


def test_a_module_without_a_target_fails(tree_copy):
  before = missing_targets(tree_copy)
  (tree_copy / "jaxkv" / "new_module.py").write_text("from jaxkv import config\n")
  (tree_copy / TESTS / "test_new_module.py").write_text("import helpers\nfrom jaxkv import new_module\n")
  problems = [p for p in missing_targets(tree_copy) if p not in before]
  assert [p.split(":")[0] for p in problems] == ["jaxkv/new_module.py", "tests/test_new_module.py"]
  assert '":jaxkv_config"' in problems[0] and 'name = "test_new_module"' in problems[1]
  assert '":jaxkv_new_module"' in problems[1] and '":tests_helpers"' in problems[1]


def test_a_subpackage_module_is_named_by_its_path(tree_copy):
  before = missing_targets(tree_copy)
  (tree_copy / "jaxkv" / "bench" / "new_module.py").write_text("from jaxkv.bench import arms\n")
  problems = [p for p in missing_targets(tree_copy) if p not in before]
  assert [p.split(":")[0] for p in problems] == ["jaxkv/bench/new_module.py"]
  assert 'name = "jaxkv_bench_new_module"' in problems[0] and '":jaxkv_bench_arms"' in problems[0]


def test_a_dangling_dep_and_a_missing_import_fail(tree_copy):
  build = (tree_copy / "BUILD").read_text()
  broken = build.replace('deps = [":jaxkv_config"],', 'deps = [":jaxkv_confg"],', 1)
  assert broken != build
  (tree_copy / "BUILD").write_text(broken)
  assert [p for p in dangling_deps(tree_copy) if "jaxkv_confg" in p]
  assert [p for p in wrong_deps(tree_copy) if "missing deps ['jaxkv_config']" in p]


def test_a_dep_listed_twice_fails(tree_copy):
  build = (tree_copy / "BUILD").read_text()
  twice = build.replace('deps = [":jaxkv_config"],', 'deps = [":jaxkv_config", ":jaxkv_config"],', 1)
  assert twice != build
  (tree_copy / "BUILD").write_text(twice)
  assert [p for p in wrong_deps(tree_copy) if "deps listed twice ['jaxkv_config']" in p]


# The entry points that start an app (python3 -m jaxkv.generate ...) and the bench's package, an app of its own.
APP_ENTRIES = ("jaxkv/generate.py", "jaxkv/gates.py", "jaxkv/serve.py", "jaxkv/serve_bench.py")


def test_the_library_imports_no_app_code():
  library = [
      m
      for m in modules(ROOT)
      if m.startswith("jaxkv/") and not m.startswith(("jaxkv/apps/", "jaxkv/bench/")) and m not in APP_ENTRIES
  ]
  assert "jaxkv/engine.py" in library and "jaxkv/run.py" in library
  for m in library:
    apps = sorted(p for p in first_party_imports(ROOT, m) if p.startswith("jaxkv/apps/") or p in APP_ENTRIES)
    assert not apps, (m, apps)
