"""Print the requirements of ringserve's base dependencies and the given extras, one per line.

The image build installs them in a layer of their own, read from pyproject.toml alone, so
that a change to the code (a new ringserve wheel) leaves the dependency layers cached.
Usage: ``python requirements.py PYPROJECT EXTRA...``.
"""

import sys

import tomllib

project = tomllib.load(open(sys.argv[1], "rb"))["project"]
requirements = list(project["dependencies"])
for extra in sys.argv[2:]:
    requirements += project["optional-dependencies"][extra]
print("\n".join(dict.fromkeys(requirements)))
