"""MkDocs hook: adds the configuration reference (reference/config.md), generated from the schema on every build.

The page is a file of the build only (mrl/config/reference.py writes it from mrl/config/schema.py); nothing is
written into docs/, so the reference cannot drift from the code.
"""

from __future__ import annotations

from mkdocs.structure.files import File, Files

from mrl.config.reference import PAGE_PATH, config_reference_markdown


def on_files(files: Files, config) -> Files:
    stale = files.get_file_from_path(PAGE_PATH)
    if stale is not None:  # a hand-written copy would be silently stale: the generated page replaces it
        files.remove(stale)
    files.append(File.generated(config, PAGE_PATH, content=config_reference_markdown()))
    return files
