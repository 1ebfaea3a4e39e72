"""Every page's blocks that no test of tests/test_docs.py runs, run in order by that file's rules (shortened where
``SHORTEN`` says). A file of its own so that xdist can run its minutes beside the other pages'."""
from __future__ import annotations

import pytest
from test_docs import FIXTURES, ROOT, SHORTEN, code_blocks, page_text, pages, run_blocks, work_dir


@pytest.mark.parametrize("page", [p for p in pages() if page_text(p).count("```")])
def test_page_commands_run(tmp_path, page):
    """Every block of a page that tests/test_docs.py does not run: run in order (shortened where ``SHORTEN`` says),
    its output compared with the page's, or parsed where the page marks it not run here."""
    work, env = work_dir(tmp_path)
    for name, text in FIXTURES.get(page, {}).items():
        if isinstance(text, tuple):  # (language, k): the page's k-th block of that language
            text = [code for lang, _, code, _ in code_blocks((ROOT / page).read_text()) if lang == text[0]][text[1]]
        (work / name).write_text(text)
    run_blocks(page, page_text(page), work, env, short=page in SHORTEN, python=False)
