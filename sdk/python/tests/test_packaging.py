"""The SDK installs from the checkout under its own distribution name and writes nothing
into the checkout (no build/, no *.egg-info): pip builds it out of tree."""

import os
import subprocess
import sys
import tempfile

SDK = os.path.realpath(os.path.join(os.path.dirname(__file__), ".."))
ROOT = os.path.realpath(os.path.join(SDK, "..", ".."))


def checkout_state():
    p = subprocess.run(["git", "-C", ROOT, "status", "--porcelain", "--ignored", "--untracked-files=all", "--", "sdk/python"],
                       capture_output=True, text=True, check=True)
    return sorted(line for line in p.stdout.splitlines() if "__pycache__" not in line)


def test_install_from_the_checkout_leaves_it_clean_and_names_the_distribution():
    before = checkout_state()
    with tempfile.TemporaryDirectory() as target:
        p = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--disable-pip-version-check", "--no-deps",
                            "--target", target, SDK], capture_output=True, text=True, timeout=300)
        assert p.returncode == 0, p.stdout + p.stderr
        assert checkout_state() == before, "pip install ./sdk/python wrote into the checkout"
        dist = [d for d in os.listdir(target) if d.endswith(".dist-info")]
        assert dist == ["locker_sandbox-0.1.0.dist-info"], dist
        assert os.path.isfile(os.path.join(target, "locker", "client.py")), "the import name stays `locker`"
        assert os.path.isfile(os.path.join(target, "locker", "testing.py"))
        check = subprocess.run([sys.executable, "-c", "import locker, sys; print(locker.__file__); import locker.testing"],
                               env=dict(os.environ, PYTHONPATH=target), capture_output=True, text=True, cwd=target)
        assert check.returncode == 0 and check.stdout.startswith(target), check.stdout + check.stderr
