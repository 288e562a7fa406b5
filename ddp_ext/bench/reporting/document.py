"""Fills docs/BENCHMARKS.md from result files: `python -m ddp_ext.bench report --out DIR`.

The document is written by people, except between marker lines

    <!-- BEGIN GENERATED: name -->
    <!-- END GENERATED: name -->

which this module replaces with the section rendered from DIR/name.json
(command, machine, table, figure). Text outside the markers, such as the
comparison with the paper's findings, is left alone. Results with no block in
the document get one appended at the end.
"""

import os
import re

from ddp_ext.bench.harness.progress import Progress
from ddp_ext.bench.reporting import results

BEGIN = "<!-- BEGIN GENERATED: {name} -->"
END = "<!-- END GENERATED: {name} -->"


def _block(name: str, body: str) -> str:
    return f"{BEGIN.format(name=name)}\n{body.rstrip()}\n{END.format(name=name)}"


def replace_block(document: str, name: str, body: str) -> str:
    """`document` with the generated block `name` holding `body`; appended if absent."""
    pattern = re.compile(re.escape(BEGIN.format(name=name)) + r".*?" + re.escape(END.format(name=name)), re.DOTALL)
    if pattern.search(document):
        return pattern.sub(lambda _: _block(name, body), document, count=1)
    return document.rstrip() + f"\n\n## {name}\n\n{_block(name, body)}\n"


def update_document(out_dir: str, doc_path: str) -> None:
    from ddp_ext.bench.runner import render_outputs, render_section

    progress = Progress("report")
    with open(doc_path) as f:
        document = f.read()
    found = results.found(out_dir)
    if not found:
        raise FileNotFoundError(f"no result files (*.json) in {out_dir}; run an experiment with --out {out_dir} first")
    for json_path in found:
        name = os.path.splitext(os.path.basename(json_path))[0]
        data = results.read_json(json_path)
        files = render_outputs(data, out_dir, name)
        figure = os.path.relpath(os.path.abspath(files["png"]), os.path.dirname(os.path.abspath(doc_path)))
        body = render_section(data, figure)
        document = replace_block(document, name, body)
        progress.say(f"{doc_path}: filled {name} from {json_path}")
    with open(doc_path, "w") as f:
        f.write(document)
