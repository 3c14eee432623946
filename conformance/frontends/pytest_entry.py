"""The `pytest11` entry point of gradparity: loads the suite's plugin only where the suite is installed.

pytest loads every installed distribution's `pytest11` entry point in every run, the user's own
unrelated test runs included. In an environment where gradparity was installed for refimpl only
(`pip install gradparity`, torch and nothing else), importing the plugin itself would fail and
take those runs down; so this module names the plugin in `pytest_plugins` only when the `suite`
extra is there (`conformance.frontends.extras`), and is otherwise an empty plugin. Running the suite there
(`pytest --pyargs conformance.suite`) stops at the suite's own import with one line saying what
to install.
"""

from conformance.frontends.extras import missing

pytest_plugins = [] if missing() else ["conformance.frontends.plugin"]
