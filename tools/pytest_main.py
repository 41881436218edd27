"""The main of every py_test in BUILD: Bazel runs a py_test's main as a script, so this runs pytest on the test
files given as arguments (exit status 5, no test collected, fails the target).

Under `bazel test`, imports must come from the runfiles tree, so that a missing dep fails: the finder of an
editable install (`pip install -e .`), which would import any jaxkv module from the checkout, is dropped.
"""

import os
import sys

import pytest

if __name__ == "__main__":
  args = ["-p", "no:cacheprovider", *sys.argv[1:]]
  if "TEST_SRCDIR" in os.environ:  # Set by `bazel test`.
    sys.meta_path[:] = [f for f in sys.meta_path if not getattr(f, "__module__", "").startswith("__editable__")]
  if "XML_OUTPUT_FILE" in os.environ:  # Per-test results in Bazel's test.xml.
    args.append(f"--junitxml={os.environ['XML_OUTPUT_FILE']}")
  sys.exit(pytest.main(args))
