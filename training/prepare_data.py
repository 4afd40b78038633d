"""Extract Jane Austen's six novels from Debian's ``r-cran-janeaustenr`` package into plain text.

The package ships the novels as an R lazy-load database (``data/Rdata.rdx`` + ``data/Rdata.rdb``):
the ``.rdx`` index is a gzip'd R serialization of a named list ``variables -> (offset, length)``,
and each ``.rdb`` record is a 4-byte big-endian uncompressed length followed by a zlib stream
holding an R serialization (XDR format) of one character vector: the book's lines.  A minimal
reader for the subset of R's serialization format that these two objects use lives below, so
no R and no extra Python package is needed.

Output (``training/data/``, gitignored):
    train.txt, val.txt   books separated by ``<|endoftext|>``; paragraphs separated by a blank line
    books.json           per-book character counts, for the record

Held-out split: the final ``--val-frac`` (default 4%) of each book's paragraphs.

Usage:
    python training/prepare_data.py                 # downloads the .deb with `apt-get download`
    python training/prepare_data.py --deb path.deb  # or use a .deb you already have
"""
from __future__ import annotations

import argparse
import glob
import gzip
import json
import os
import re
import struct
import subprocess
import tempfile
import zlib

PACKAGE = "r-cran-janeaustenr"
DATA_SUBDIR = "usr/lib/R/site-library/janeaustenr/data"
EOT = "<|endoftext|>"
# Fixed order so that the output is byte-for-byte reproducible.
BOOKS = ["sensesensibility", "prideprejudice", "mansfieldpark", "emma", "northangerabbey", "persuasion"]


# ----------------------------------------------------------------------------------------------
# Minimal R serialization (XDR, version 2/3) reader
# ----------------------------------------------------------------------------------------------
NILVALUE_SXP, NILSXP, LISTSXP, SYMSXP, CHARSXP = 254, 0, 2, 1, 9
LGLSXP, INTSXP, REALSXP, STRSXP, VECSXP = 10, 13, 14, 16, 19
REFSXP = 255


class _RReader:
    def __init__(self, buf: bytes):
        self.buf, self.pos, self.refs = buf, 0, []

    def _int(self) -> int:
        (v,) = struct.unpack_from(">i", self.buf, self.pos)
        self.pos += 4
        return v

    def read_file(self):
        if self.buf[:2] != b"X\n":
            raise ValueError("not an XDR R serialization")
        self.pos = 2
        version = self._int()
        self._int(), self._int()  # writer R version, min reader version
        if version == 3:
            n = self._int()
            self.pos += n  # native encoding name
        return self.read_item()

    def read_item(self):
        flags = self._int()
        typ = flags & 0xFF
        has_attr, has_tag = bool(flags & (1 << 9)), bool(flags & (1 << 10))
        if typ in (NILVALUE_SXP, NILSXP):
            return None
        if typ == REFSXP:
            return self.refs[(flags >> 8) - 1]
        if typ == SYMSXP:
            name = self.read_item()
            self.refs.append(name)
            return name
        if typ == CHARSXP:
            n = self._int()
            if n == -1:
                return None
            s = self.buf[self.pos : self.pos + n].decode("utf-8", errors="replace")
            self.pos += n
            return s
        if typ == LISTSXP:  # pairlist: (attr) (tag) car cdr
            attr = self.read_item() if has_attr else None
            tag = self.read_item() if has_tag else None
            car = self.read_item()
            cdr = self.read_item()
            out = [(tag, car)] + (cdr if isinstance(cdr, list) else [])
            del attr
            return out
        if typ in (LGLSXP, INTSXP):
            n = self._int()
            vals = list(struct.unpack_from(f">{n}i", self.buf, self.pos))
            self.pos += 4 * n
        elif typ == REALSXP:
            n = self._int()
            vals = list(struct.unpack_from(f">{n}d", self.buf, self.pos))
            self.pos += 8 * n
        elif typ in (STRSXP, VECSXP):
            n = self._int()
            vals = [self.read_item() for _ in range(n)]
        else:
            raise ValueError(f"unsupported R SEXP type {typ}")
        attrs = dict(self.read_item()) if has_attr else {}
        names = attrs.get("names")
        if names is not None and typ == VECSXP:
            return dict(zip(names, vals))
        return vals


def read_r_object(buf: bytes):
    return _RReader(buf).read_file()


def load_books(data_dir: str) -> dict[str, list[str]]:
    """Return {book: list of lines} from an R lazy-load database directory."""
    index = read_r_object(gzip.decompress(open(os.path.join(data_dir, "Rdata.rdx"), "rb").read()))
    rdb = open(os.path.join(data_dir, "Rdata.rdb"), "rb").read()
    books = {}
    for name, (offset, length) in index["variables"].items():
        record = rdb[offset : offset + length]
        books[name] = read_r_object(zlib.decompress(record[4:]))
    return books


# ----------------------------------------------------------------------------------------------
# Cleaning
# ----------------------------------------------------------------------------------------------
def to_paragraphs(lines: list[str]) -> list[str]:
    """Join hard-wrapped lines into paragraphs; drop italics underscores; normalise spaces."""
    paras, cur = [], []
    for line in lines + [""]:
        line = (line or "").strip()
        if line:
            cur.append(line)
        elif cur:
            paras.append(" ".join(cur))
            cur = []
    out = []
    for p in paras:
        p = p.replace("_", "")
        p = re.sub(r"\s+", " ", p).strip()
        if p:
            out.append(p)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--deb", help="path to r-cran-janeaustenr_*.deb (default: apt-get download it)")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "data"))
    ap.add_argument("--val-frac", type=float, default=0.04)
    args = ap.parse_args()

    os.makedirs(args.out, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        deb = args.deb
        if deb is None:
            os.chmod(tmp, 0o755)  # let apt's unprivileged `_apt` user write the download here
            subprocess.run(["apt-get", "download", PACKAGE], cwd=tmp, check=True)
            deb = glob.glob(os.path.join(tmp, f"{PACKAGE}_*.deb"))[0]
        print(f"using {os.path.basename(deb)}")
        subprocess.run(["dpkg-deb", "-x", deb, os.path.join(tmp, "x")], check=True)
        books = load_books(os.path.join(tmp, "x", DATA_SUBDIR))

    train_docs, val_docs, stats = [], [], {}
    for name in BOOKS:
        paras = to_paragraphs(books[name])
        n_val = max(1, int(round(len(paras) * args.val_frac)))
        train_docs.append("\n\n".join(paras[:-n_val]))
        val_docs.append("\n\n".join(paras[-n_val:]))
        stats[name] = {"paragraphs": len(paras), "val_paragraphs": n_val,
                       "train_chars": len(train_docs[-1]), "val_chars": len(val_docs[-1])}
    sep = f"\n{EOT}\n"
    for fname, docs in (("train.txt", train_docs), ("val.txt", val_docs)):
        with open(os.path.join(args.out, fname), "w", encoding="utf-8") as f:
            f.write(sep.join(docs) + "\n")
    with open(os.path.join(args.out, "books.json"), "w") as f:
        json.dump(stats, f, indent=1)
    tot_t = sum(s["train_chars"] for s in stats.values())
    tot_v = sum(s["val_chars"] for s in stats.values())
    print(f"wrote {args.out}/train.txt ({tot_t:,} chars) and val.txt ({tot_v:,} chars)")


if __name__ == "__main__":
    main()
