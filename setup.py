"""Package discovery that pyproject.toml cannot express on its own.

`fixtures/` lives at the top of the repository (DESIGN.md's layout) but must install as
`conformance.fixtures`: a top-level `fixtures` module would shadow the widely used PyPI
package of that name.
"""

from setuptools import find_packages, setup

packages = find_packages(include=["refimpl", "refimpl.*", "conformance", "conformance.*"])
packages += ["conformance.fixtures"] + [
    "conformance.fixtures." + name for name in find_packages(where="fixtures")
]

setup(
    packages=packages,
    package_dir={"conformance.fixtures": "fixtures"},
    package_data={"conformance": ["report/*.css", "py.typed"]},
)
