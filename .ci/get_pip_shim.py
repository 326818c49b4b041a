"""Stand-in for ansible-test's get-pip bootstrap script, whose download host is unreachable here.

ansible-test runs this file with get-pip's arguments (pip options, then the packages to install).
We bootstrap pip from the interpreter's own ensurepip, then let that pip install the same packages
from the configured package index.
"""

import subprocess
import sys

GET_PIP_ONLY_OPTIONS = {"--no-setuptools", "--no-wheel"}


def main() -> None:
    subprocess.check_call([sys.executable, "-m", "ensurepip", "--upgrade", "--default-pip"])
    args = [a for a in sys.argv[1:] if a not in GET_PIP_ONLY_OPTIONS]
    subprocess.check_call([sys.executable, "-m", "pip", "install", *args])


if __name__ == "__main__":
    main()
