"""README.md's support matrix, rendered from the family registry (`compressor/modeling/families.py`): a cell is
**tiny** where the registry accepts the form (tests/test_families.py runs it on a tiny random model of the family
and reloads the checkpoint in plain transformers with the run's logits) and **refused** where it refuses it
(the same test checks the one line, exit code 2, nothing written); the reason is the refusal's own words. The
GGUF column is the llama.cpp architecture the registry names (tests/test_gguf_export.py runs the files in
llama.cpp), or refused by `export` in one line.
"""

from __future__ import annotations

from compressor.modeling.families import FAMILIES, FORMS, refusal_of

SUPERSCRIPTS = "¹²³⁴⁵⁶⁷⁸⁹"


def _reason(refusal: str) -> str:
    """A refusal without the family's name: `--native on olmo2: its q_norm ...` -> `its q_norm ...`."""
    return refusal.split(": ", 1)[1]


def support_matrix(results_dir=None) -> str:
    """The table (one row per family, one column per form) and the footnotes giving each refusal's reason."""
    header = ["family (`model_type`)", *(form.heading for form in FORMS), "GGUF export"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    notes: dict[str, tuple[str, list[str]]] = {}  # reason -> (mark, the forms and families it refuses)
    for name, family in FAMILIES.items():
        cells = []
        for form in FORMS:
            refusal = refusal_of(name, form)
            if refusal is None:
                cells.append("tiny")
                continue
            reason = _reason(refusal)
            mark, where = notes.setdefault(reason, (SUPERSCRIPTS[len(notes)], []))
            where.append(f"{refusal.split(' on ')[0]} on {family.title}")
            cells.append(f"refused{mark}")
        cells.append(f"`{family.llama_cpp}`" if family.llama_cpp else "refused")
        lines.append(f"| {family.title} (`{name}`) | " + " | ".join(cells) + " |")
    lines.append("")
    for reason, (mark, where) in notes.items():
        lines.append(f"{mark} {', '.join(dict.fromkeys(where))}: {reason}.")
    return "\n".join(lines)
