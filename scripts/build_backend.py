"""The PEP 517 build backend: setuptools, run on a copy of the sources.

setuptools writes ``build/`` and ``sluice_llm.egg-info/`` beside the sources it builds, so ``pip install .`` would
leave both in the user's checkout. Built from a copy in a temporary folder, a wheel or an sdist leaves the tree as
it was. An editable install (``pip install -e .``, what ``make install`` does) must build in place, and does.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator

from setuptools import build_meta as _setuptools
from setuptools.build_meta import (  # noqa: F401 - the editable hooks build in place, as they must
    build_editable,
    get_requires_for_build_editable,
    prepare_metadata_for_build_editable,
)

# What a distribution is built from (the package folders, the project's metadata) and this backend, which an
# sdist must carry to be built again.
SOURCES = ("app", "core", "kv", "spec", "pyproject.toml", "README.md", "scripts/build_backend.py")


@contextlib.contextmanager
def _in_a_copy() -> Iterator[None]:
    here = os.getcwd()
    with tempfile.TemporaryDirectory(prefix="sluice-build-") as tmp:
        for name in SOURCES:
            src, dst = os.path.join(here, name), os.path.join(tmp, name)
            if os.path.isdir(src):
                shutil.copytree(src, dst, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
            else:
                os.makedirs(os.path.dirname(dst), exist_ok=True)
                shutil.copy2(src, dst)
        with open(os.path.join(tmp, "MANIFEST.in"), "w") as fh:
            fh.write("include scripts/build_backend.py\n")
        os.chdir(tmp)
        try:
            yield
        finally:
            os.chdir(here)


# setuptools' get_requires_* hooks run ``egg_info`` where they stand (an isolated `pip install .` asks for them
# first, before the metadata), so they too run in a copy.
def get_requires_for_build_wheel(config_settings=None):
    with _in_a_copy():
        return _setuptools.get_requires_for_build_wheel(config_settings)


def get_requires_for_build_sdist(config_settings=None):
    with _in_a_copy():
        return _setuptools.get_requires_for_build_sdist(config_settings)


def build_wheel(wheel_directory, config_settings=None, metadata_directory=None):
    wheel_directory = os.path.abspath(wheel_directory)
    metadata_directory = metadata_directory and os.path.abspath(metadata_directory)
    with _in_a_copy():
        return _setuptools.build_wheel(wheel_directory, config_settings, metadata_directory)


def build_sdist(sdist_directory, config_settings=None):
    sdist_directory = os.path.abspath(sdist_directory)
    with _in_a_copy():
        return _setuptools.build_sdist(sdist_directory, config_settings)


def prepare_metadata_for_build_wheel(metadata_directory, config_settings=None):
    metadata_directory = os.path.abspath(metadata_directory)
    with _in_a_copy():
        return _setuptools.prepare_metadata_for_build_wheel(metadata_directory, config_settings)
