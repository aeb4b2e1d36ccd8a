"""The engine tests' tiny Llama (engine_cases.model, module-scoped) as a fixture of this
folder: a test takes ``model`` and gets it, unless its module defines its own."""

from engine_cases import model  # noqa: F401
