"""Every relative link of the docs leads somewhere: a file or folder of the repository and, with an
anchor, a heading of that file."""

from __future__ import annotations

from urllib.parse import unquote

from support.docfiles import READER_DOCS, ROOT, anchors, doc_files, links, where


def test_each_reader_has_a_guide_and_the_readme_links_to_each() -> None:
    missing = [name for name in READER_DOCS if not (ROOT / name).is_file()]
    assert not missing, f"missing: {', '.join(missing)}"
    linked = {target.partition("#")[0] for _, target in links(ROOT / "README.md")}
    unlinked = [name for name in READER_DOCS[1:] if name not in linked]
    assert not unlinked, f"README.md doesn't link to {', '.join(unlinked)}"


def test_every_relative_link_points_at_a_file_and_heading_that_exist() -> None:
    dead = []
    checked = 0
    for path in doc_files():
        for line, target in links(path):
            if target.startswith(("http://", "https://", "mailto:")):
                continue
            checked += 1
            file_part, _, anchor = unquote(target).partition("#")
            destination = (path.parent / file_part).resolve() if file_part else path
            if not destination.exists() or not destination.is_relative_to(ROOT):
                dead.append(f"{where(path, line)}: {target}: no file {file_part}")
            elif anchor and destination.suffix == ".md" and anchor not in anchors(destination):
                dead.append(f"{where(path, line)}: {target}: no heading #{anchor} in {destination.relative_to(ROOT)}")
    assert checked, "no relative links found: is the link pattern still right?"
    assert not dead, "\n".join(dead)
