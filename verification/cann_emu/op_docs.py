"""Reads aclnn operators' dtype support for Atlas A2 training products out of CANN's own documents.

    python verification/cann_emu/op_docs.py DOCS_ROOT aclnnMul aclnnSilu ...   # prints op_table.json rows
    python verification/cann_emu/op_docs.py DOCS_ROOT --check                 # op_table.json against the documents

DOCS_ROOT holds checkouts of hicann/ops-math, ops-nn, ops-cv and ops-transformer (one folder each, any
names) at the emulated release (their 9.1.0 branches: a master describes a later CANN): each operator's
document (``docs/aclnn<Op>*.md``) has a parameter table per function with a data-type column. A cell
may name products ("<term>Atlas A2 训练系列产品</term>：FLOAT16、BFLOAT16"); the clause for Atlas A2
training products is taken, else the cell's product-free part. "同self"-style cells
("数据类型与self一致", "same as self") copy the named parameter's list. The notes below the table narrow
it per product ("- <term>Atlas A2 训练系列产品/...</term>、<term>Atlas A3 ...</term>：不支持COMPLEX64。",
"self和out的数据类型不支持BOOL"): what a note naming Atlas A2 excludes leaves the row (for every tensor
parameter, or for those the note names), and the row's "a2_notes" quotes it. A cell lists what the
operator takes on some product; only these notes say which. Rows the reader cannot settle (an A2 note
that names a dtype but excludes none the reader recognises, e.g. "当输入数据类型为BFLOAT16时不支持该选项")
are printed with "verified": false and the raw text, for a person to read.

This is how op_table.json's rows were made and how they are re-checked; nothing here runs in the
emulation.
"""

from __future__ import annotations

import argparse
import html
import json
import re
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
DTYPE_WORDS = {
    "FLOAT32": "FLOAT", "FLOAT": "FLOAT", "FLOAT16": "FLOAT16", "BFLOAT16": "BFLOAT16", "DOUBLE": "DOUBLE",
    "FLOAT64": "DOUBLE", "INT8": "INT8", "INT16": "INT16", "INT32": "INT32", "INT64": "INT64", "UINT8": "UINT8",
    "UINT16": "UINT16", "UINT32": "UINT32", "UINT64": "UINT64", "BOOL": "BOOL", "COMPLEX64": "COMPLEX64",
    "COMPLEX128": "COMPLEX128", "COMPLEX32": "COMPLEX32", "HIFLOAT8": "HIFLOAT8", "FLOAT8_E5M2": "FLOAT8_E5M2",
    "FLOAT8_E4M3FN": "FLOAT8_E4M3FN", "FLOAT8_E8M0": "FLOAT8_E8M0", "INT4": "INT4",
}
A2 = "Atlas A2 训练系列产品"
TAG = re.compile(r"<[^>]+>")


def find_doc(root: Path, op: str) -> Path | None:
    """The document of op: docs/<op>.md, or a combined one (docs/aclnnAdd&aclnnInplaceAdd.md)."""
    exact, combined = [], []
    for path in root.rglob("aclnn*.md"):
        if path.parent.name != "docs" or path.stem.endswith("_en"):
            continue
        names = path.stem.split("&")
        if path.stem == op:
            exact.append(path)
        elif op in names:
            combined.append(path)
    # CANN's experimental/ folders hold drafts of operators documented again outside them.
    order = lambda p: ("experimental" in p.parts, str(p))  # noqa: E731
    found = sorted(exact, key=order) or sorted(combined, key=order)
    return found[0] if found else None


def _cells(row: str) -> list[str]:
    return [html.unescape(TAG.sub(" ", c)).strip() for c in re.findall(r"<td[^>]*>(.*?)</td>", row, flags=re.S)]


def _dtypes(text: str) -> list[str]:
    words = re.findall(r"[A-Z][A-Z0-9_]+", text)
    out = []
    for w in words:
        d = DTYPE_WORDS.get(w)
        if d and d not in out:
            out.append(d)
    return out


def _a2_part(raw_html: str) -> tuple[str, bool]:
    """The part of a data-type cell that holds for Atlas A2 training products, and whether it is plain."""
    if "<term>" not in raw_html:
        return html.unescape(TAG.sub(" ", raw_html)), True
    # Clauses "<term>products</term>：dtypes" separated by list items or line breaks.
    clauses = re.split(r"<li>|<br\s*/?>|\n", raw_html)
    for clause in clauses:
        terms = " ".join(re.findall(r"<term>(.*?)</term>", clause))
        if A2 in terms:
            body = clause.split("</term>")[-1]
            return html.unescape(TAG.sub(" ", body)), True
    return html.unescape(TAG.sub(" ", raw_html)), False


def tensor_parameters(text: str, op: str) -> set[str] | None:
    """The aclTensor / aclTensorList parameters of op's GetWorkspaceSize, from the document's prototype."""
    proto = re.search(re.escape(op) + r"GetWorkspaceSize\s*\(([^;{)]*)\)", text)
    if not proto:
        return None
    names = set()
    for param in proto.group(1).split(","):
        words = re.findall(r"\w+", param)
        if words and any(w in ("aclTensor", "aclTensorList") for w in words):
            names.add(words[-1])
    return names


def parameter_table(text: str, op: str) -> tuple[dict[str, tuple[str, list[str], bool]], int] | None:
    """({parameter: (raw cell, dtypes, settled)}, where the table ends) for the table documenting op's
    GetWorkspaceSize."""
    tensors = tensor_parameters(text, op)
    best, best_score = None, (0, 0)
    for match in re.finditer(r"<table.*?</table>", text, flags=re.S):
        table = match.group(0)
        header = [TAG.sub("", h).strip() for h in re.findall(r"<th[^>]*>(.*?)</th>", table, flags=re.S)]
        if "数据类型" not in header:
            continue
        col = header.index("数据类型")
        rows = {}
        for row in re.findall(r"<tr[^>]*>(.*?)</tr>", table, flags=re.S):
            raw_cells = re.findall(r"<td[^>]*>(.*?)</td>", row, flags=re.S)
            if len(raw_cells) <= col:
                continue
            kind = html.unescape(TAG.sub("", raw_cells[0]))
            name = re.split(r"[（(]", kind)[0].strip()
            typed = re.search(r"[（(]", kind)
            if typed and "aclTensor" not in kind:  # scalars, arrays and plain values are not tensor-checked
                continue
            if not re.fullmatch(r"[A-Za-z_]\w*", name):
                continue
            part, plain = _a2_part(raw_cells[col])
            rows[name] = (html.unescape(TAG.sub(" ", raw_cells[col])).strip(), _dtypes(part), plain)
        # The table documenting this function names exactly its tensor parameters (a combined document
        # has one table per function: aclnnDiv's self/other/out, aclnnInplaceDiv's selfRef/other).
        wanted = tensors if tensors is not None else set(rows)
        score = (len(wanted & set(rows)), -len(set(rows) - wanted))
        if score[0] and score > best_score:
            best, best_score = ({k: v for k, v in rows.items() if k in wanted}, match.end()), score
    return best


# Where the notes below a parameter table end: the next table, heading, or bold item ("- **返回值**").
NOTES_END = re.compile(r"<table|\n\s*#|\n\s*-\s*\*\*|\*\*返回值\*\*")
# A run of dtype names ("COMPLEX64", "INT8、UINT8", "`FLOAT16`和`BFLOAT16`"): one character class, no nesting.
DTYPE_RUN = r"(`?[A-Z][A-Z0-9_`、,，和及/ ]*)"


def product_notes(text: str, table_end: int, names: set[str]) -> tuple[dict[str, set[str]], list[str], list[str]]:
    """What the notes below a parameter table exclude on Atlas A2: ({parameter: dtypes}, the notes applied,
    the A2 notes that name a dtype but exclude none the reader recognises)."""
    region = text[table_end:]
    end = NOTES_END.search(region)
    # One note per product clause: "<term>products</term>、<term>...</term>：body", the body going on over the
    # lines below it up to the next clause (a note may also miss its closing </term>).
    notes: list[tuple[str, list[str]]] = []
    for line in (region[:end.start()] if end else region).splitlines():
        if "<term>" in line:
            head, colon, body = line.partition("：") if "：" in line else line.partition(":")
            notes.append((head if colon else line, [body]))
        elif notes:
            notes[-1][1].append(line)
    excluded: dict[str, set[str]] = {}
    applied, unsettled = [], []
    for head, body_lines in notes:
        if A2 not in TAG.sub(" ", head):
            continue
        body = html.unescape(TAG.sub(" ", " ".join(body_lines)))
        quoted = " ".join(f"{TAG.sub('', head).strip().lstrip('-* ').strip()}：{body}".split())
        for sentence in re.split(r"[。；;]", body):
            found = (re.search(r"不支持\s*" + DTYPE_RUN, sentence)
                     or re.search(DTYPE_RUN + r"数据类型在该型号中不支持", sentence))
            dtypes = set(_dtypes(found.group(1))) if found else set()
            if not dtypes:
                if "不支持" in sentence and _dtypes(sentence) and quoted not in unsettled:
                    unsettled.append(quoted)
                continue
            # ASCII names: \w would read "self和out" as one word.
            named = set(re.findall(r"[A-Za-z_][A-Za-z0-9_]*", sentence[:found.start()])) & names
            for name in named or names:
                excluded.setdefault(name, set()).update(dtypes)
            if quoted not in applied:
                applied.append(quoted)
    return excluded, applied, unsettled


def parameter_list(text: str, op: str) -> dict[str, tuple[str, list[str], bool]] | None:
    """The same from a document that lists parameters as bullets ("- self（aclTensor*，计算输入）：...
    数据类型支持FLOAT、..."), with per-product sub-bullets ("- <term>Atlas A2 训练系列产品</term>：...")."""
    func = op + "GetWorkspaceSize"
    sections = re.split(r"\n(?=#+ )", text)
    chosen = [sec for sec in sections if func in sec.split("\n", 1)[0]] or [text]
    rows: dict[str, tuple[str, list[str], bool]] = {}
    current, raw = None, []
    def close():
        if current is None:
            return
        cell = "\n".join(raw)
        a2 = [line for line in raw if "<term>" in line and A2 in line]
        text_part = a2[0].split("</term>")[-1] if a2 else (cell if "<term>" not in cell else "")
        supported = re.findall(r"数据类型(?:支持|仅支持)([^。；;]*)", text_part) or ([text_part] if a2 else [])
        dtypes = _dtypes(" ".join(supported))
        rows[current] = (TAG.sub(" ", cell).strip(), dtypes, bool(a2) or "<term>" not in cell)
    for line in chosen[0].splitlines():
        bullet = re.match(r"\s*-\s*([A-Za-z_]\w*)\s*[（(]\s*(?:const\s+)?aclTensor(?:List)?\b", line)
        if bullet:
            close()
            current, raw = bullet.group(1), [line]
        elif re.match(r"\s*-\s*[A-Za-z_]\w*\s*[（(]", line):
            close()
            current, raw = None, []
        elif current is not None and re.match(r"\s+-", line):
            raw.append(line)
    close()
    return rows or None


def table_rows(root: Path, op: str) -> dict:
    doc = find_doc(root, op)
    if doc is None:
        return {"error": f"no document docs/{op}*.md under {root}"}
    text = doc.read_text(errors="ignore")
    found = parameter_table(text, op)
    rows, table_end = found if found else (parameter_list(text, op), None)
    repo_root = next((p for p in doc.parents if (p / ".git").exists() or p.parent == root), doc.parent)
    source = f"hicann/{repo_root.name} {doc.relative_to(repo_root)}" if repo_root != doc.parent else str(doc)
    if rows is None:
        return {"error": f"{doc}: no parameter table with a data-type column after {op}GetWorkspaceSize"}
    args, settled, notes = {}, True, {}
    for name, (raw, dtypes, plain) in rows.items():
        same = re.search(r"[与和]\s*[`“\"]?([A-Za-z_][A-Za-z0-9_]*)[`”\"]?\s*(?:参数)?(?:的数据类型)?\s*(?:保持)?(?:一致|相同)|same as `?(\w+)`?", raw)
        if not dtypes and same:
            ref = same.group(1) or same.group(2)
            dtypes = args.get(ref) or rows.get(ref, ("", [], False))[1]
        if not dtypes or not plain:
            settled = False
            notes[name] = raw
        args[name] = dtypes
    a2_notes = []
    if table_end is not None:
        excluded, a2_notes, unread = product_notes(text, table_end, set(args))
        for name, dtypes in excluded.items():
            args[name] = [d for d in args[name] if d not in dtypes]
        for line in unread:
            settled = False
            notes.setdefault("a2_note", line)
    entry = {"args": args, "formats": ["ND"], "engine": "AiCore", "source": source, "verified": settled}
    if a2_notes:
        entry["a2_notes"] = a2_notes
    if notes:
        entry["unsettled"] = notes
    return entry


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("docs_root", type=Path)
    parser.add_argument("ops", nargs="*")
    parser.add_argument("--check", action="store_true", help="compare op_table.json's verified rows with the documents")
    args = parser.parse_args()
    if args.check:
        table = {k: v for k, v in json.loads((HERE / "op_table.json").read_text()).items() if not k.startswith("_")}
        bad = 0
        for op, entry in sorted(table.items()):
            found = table_rows(args.docs_root, op)
            if "error" in found:
                print(f"{op}: {found['error']}")
                bad += entry["verified"]
                continue
            for arg, dtypes in entry["args"].items():
                doc = found["args"].get(arg)
                if entry["verified"] and doc is not None and sorted(doc) != sorted(dtypes):
                    print(f"{op}.{arg}: op_table.json {sorted(dtypes)} != document {sorted(doc)}")
                    bad += 1
        sys.exit(1 if bad else 0)
    print(json.dumps({op: table_rows(args.docs_root, op) for op in args.ops}, indent=2, ensure_ascii=False))


if __name__ == "__main__":
    main()
