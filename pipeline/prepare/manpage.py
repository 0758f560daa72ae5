"""Running text from roff man pages, for monolingual pretraining text (the `manpage` source format).

The design and its reasons: docs/design.md#pipelinepreparemanpagepy.
"""

from __future__ import annotations

import re
import unicodedata
from collections import Counter

from pipeline.prepare.roff_glyphs import ACCENTS, GLYPHS, GREEK, PREDEFINED_STRINGS

# Sections whose text is command syntax rather than prose (English and manpages-de's German).
SKIPPED_SECTIONS = frozenset({"SYNOPSIS", "SYNTAX", "ÜBERSICHT", "SYNOPSE"})

_JOIN = "\x00"  # left by \c: the next input line continues this word, without a space

# One escape: \(xx and \[name] glyphs, \* strings, escapes taking a one-character, (xx or
# [name] argument (font, colour, register, mark...), \s sizes, escapes with a delimited
# argument ('...'), and the one-character rest.
_ESCAPE = re.compile(
    r"""\\(?:
    \((?P<glyph2>..) | \[(?P<glyph>[^\]]*)\]
  | \*(?:\((?P<string2>..)|\[(?P<string>[^\]\ ]*)[^\]]*\]|(?P<string1>.))
  | [fFmMgkVYn][-+]?(?:\(..|\[[^\]]*\]|.)
  | s(?:[-+]?(?:\(..|\[[^\]]*\]|'[^']*'|[1-3][0-9]|[0-9]))
  | (?P<delimited>[hvwlLDoXZbxRSHNBACO])(?P<delim>.)(?P<arg>.*?)(?P=delim)
  | (?P<one>.)
  | $)""",
    re.X | re.S,
)
_ONE = {
    "-": "-",
    "e": "\\",
    "E": "\\",
    "\\": "\\",
    ".": ".",
    "'": "'",
    "`": "`",
    "~": " ",
    " ": " ",
    # every other one-character escape (\& \| \^ \/ \, \: \% ...) is nothing
    "0": " ",
    "t": " ",
    "c": _JOIN,
}
_CONTROL = re.compile(r"[.']\s*([^\s\\]*)(.*)", re.S)
_ARGUMENT = re.compile(r'\s*(?:"((?:[^"]|"")*)"?|((?:\\.|[^\s\\])+|\\$))', re.S)
_BACKSLASH = re.compile(r"\\(.)", re.S)
_CODING = re.compile(rb"coding[:=]\s*([-\w.]+)")

_FONT_SPACED = frozenset({"B", "I", "SM", "SB"})  # arguments joined by spaces
_FONT_ALTERNATING = frozenset({"BR", "IR", "RB", "RI", "BI", "IB"})  # joined without spaces
_BREAKS = frozenset({"PP", "P", "LP", "HP", "RS", "RE", "sp", "Sp"})
_BLOCKS = {"TS": "TE", "EQ": "EN", "PS": "PE", "ig": ".", "SY": "YS"}  # dropped from ... to
_DEFINES = frozenset({"de", "de1", "am", "am1"})
_MDOC = frozenset({"Dd", "Dt", "Sh", "Os"})
_MAX_STRING_DEPTH = 8


def page_encoding(head: bytes) -> str:
    """The encoding a page declares in its first two lines (`.\\" -*- coding: latin-1 -*-`, as
    preconv reads it); UTF-8 when it declares none or one Python does not know."""
    match = _CODING.search(b"\n".join(head.split(b"\n", 2)[:2]))
    if match:
        name = match.group(1).decode("ascii")
        try:
            "".encode(name)
            return name
        except LookupError:
            pass
    return "utf-8"


def man_paragraphs(text: str, min_words: int, stats: Counter) -> list[str]:
    """The paragraphs of running text of one decoded page, each on one line
    (docs/design.md#pipelinepreparemanpagepy)."""
    page = _Page(min_words, stats)
    for line in _logical_lines(text):
        if page.mdoc:
            break
        page.feed(line)
    return page.finish()


def _logical_lines(text: str):
    """Input lines with comments removed and continuation lines (ending in a backslash) joined.
    A line that was only a comment is None (it is not a blank line)."""
    pending = ""
    for raw in text.split("\n"):
        line, joins = _strip_comment(raw.rstrip("\r"))
        if line is None:
            if pending:
                continue
            yield None
            continue
        trailing = len(line) - len(line.rstrip("\\"))
        if trailing % 2:
            line, joins = line[:-1], True
        pending += line
        if not joins:
            yield pending
            pending = ""
    if pending:
        yield pending


def _strip_comment(line: str) -> tuple[str | None, bool]:
    """The line without its comment (None for a comment line), and whether the comment was `\\#` (it
    joins the next line)."""
    if line.startswith(('.\\"', "'\\\"", ".\\#", "'\\#")):
        return None, False
    if "\\" not in line:
        return line, False
    for match in _BACKSLASH.finditer(line):
        if match.group(1) in '"#':
            kept = line[: match.start()]
            return (kept if kept.strip() else None), match.group(1) == "#"
    return line, False


def _arguments(rest: str) -> list[str]:
    """A macro's arguments, raw: separated by spaces, "quoted" ones may hold
    spaces ("" is a quote)."""
    args, pos = [], 0
    while True:
        match = _ARGUMENT.match(rest, pos)
        if not match or match.end() == pos:
            return args
        quoted, plain = match.group(1), match.group(2)
        args.append(quoted.replace('""', '"') if quoted is not None else plain)
        pos = match.end()


def _named_glyph(name: str) -> str:
    if name in GLYPHS:
        return GLYPHS[name]
    if len(name) == 2 and name[0] in ACCENTS and name[1].isalpha():
        return unicodedata.normalize("NFC", name[1] + ACCENTS[name[0]])
    if len(name) == 2 and name[0] == "*" and name[1].lower() in GREEK:
        letter = GREEK[name[1].lower()]
        return letter.upper() if name[1].isupper() else letter
    if name.startswith("u") and len(name) > 1:  # \[u00E9], \[u0065_0301]
        try:
            return unicodedata.normalize(
                "NFC", "".join(_character(int(part, 16)) for part in name[1:].split("_"))
            )
        except ValueError:
            return ""
    if name.startswith("char") and name[4:].isdigit():
        return _character(int(name[4:])) if int(name[4:]) < 256 else ""
    return ""


def _character(code: int) -> str:
    """The character of a code point; nothing for controls and for what is no character
    (surrogates, too large)."""
    if code < 32 or 0xD800 <= code < 0xE000 or code >= 0x110000:
        return ""
    return chr(code)


class _Page:
    """The state of one page as its lines are fed: the paragraph being built, the modes that
    drop text, and what the page defined (strings, macros, translations)."""

    def __init__(self, min_words: int, stats: Counter):
        self.min_words, self.stats = min_words, stats
        self.paragraphs: list[str] = []
        self.current: list[str] = []
        self.strings = dict(PREDEFINED_STRINGS)
        self.macros: dict[str, str] = {}  # user macro -> its effect: "nf", "fi", "break" or ""
        self.translate: dict[int, str] = {}
        self.nofill = self.skip_section = False
        self.heading_next = self.tag_next = False
        self.until = ""  # the end request of a dropped block (.TS ... .TE, .de ... ..)
        self.defining = ""  # the macro whose body is being skipped
        self.false_depth = 0  # open \{ of a false conditional
        self.else_stack: list[bool] = []
        self.mdoc = self.so_only = False
        self.content = False  # anything besides comments, blank lines and .so

    # ------------------------------------------------------------ lines

    def feed(self, line: str | None) -> None:
        if line is None:
            return
        if self.false_depth:
            self.false_depth += line.count("\\{") - line.count("\\}")
            return
        if self.until:
            self._in_block(line)
            return
        if line[:1] in (".", "'"):
            self._request(line)
        elif not line.strip():
            self._break()
        else:
            self.content = True
            self._text(self.render(line))

    def _in_block(self, line: str) -> None:
        match = _CONTROL.match(line) if line[:1] in (".", "'") else None
        name = match.group(1) if match else None
        if name is None:
            return
        if name == self.until:
            self.until, self.defining = "", ""
        elif self.defining:
            effect = self._effect(line)
            if effect:
                self.macros[self.defining] = effect

    def _effect(self, line: str) -> str:
        """What a line of a macro body does to the text around a call: start or end
        no-fill, or break."""
        name, rest = _CONTROL.match(line).groups()
        if name in ("if", "ie", "el"):
            body = rest.lstrip()
            if name != "el":
                _, body = self._condition(rest)
            body = body.replace("\\{", "").lstrip()
            if body[:1] in (".", "'"):
                return self._effect(body)
            return ""
        if name in ("nf", "EX"):
            return "nf"
        if name in ("fi", "EE"):
            return "fi"
        if name in _BREAKS or name in ("TP", "IP"):
            return "break"
        return ""

    def _request(self, line: str) -> None:
        name, rest = _CONTROL.match(line).groups()
        if not name:
            return
        if name == "so":
            self.so_only = not self.content
            return
        if name in _MDOC and not self.paragraphs and not self.current:
            self.mdoc = True
            return
        self.content = True
        if name in ("if", "ie", "el"):
            self._conditional(name, rest)
        elif name in ("SH", "SS"):
            self._break()
            self.nofill = False
            args = _arguments(rest)
            if args:
                self._heading(" ".join(self.render(a) for a in args), name)
            else:
                self.heading_next = name
        elif name in _BREAKS:
            self._break()
        elif name in ("TP", "TQ"):
            self._break()
            self.tag_next = True
        elif name == "IP":
            self._break()
            args = _arguments(rest)
            if args:
                self._text(self.render(args[0]))
                self._break()
        elif name in _FONT_SPACED or name in _FONT_ALTERNATING:
            args = _arguments(rest)
            if args:
                glue = " " if name in _FONT_SPACED else ""
                self._text(glue.join(self.render(a) for a in args))
        elif name == "MR":  # groff 1.23: .MR page section [trailer] -> page(section)trailer
            args = [self.render(a) for a in _arguments(rest)] + ["", ""]
            self._text(f"{args[0]}({args[1]}){args[2]}" if args[0] else "")
        elif name in ("UE", "ME"):  # the end of a link: its argument is the punctuation after it
            args = _arguments(rest)
            if args and self.current:
                self.current[-1] += self.render(args[0])
        elif name in ("nf", "EX"):
            self._break()
            self.nofill = True
        elif name in ("fi", "EE"):
            self.nofill = False
        elif name in _BLOCKS:
            self._break()
            self.until = _BLOCKS[name]
        elif name in _DEFINES:
            args = _arguments(rest)
            if args:
                self.defining = args[0]
                self.macros.setdefault(args[0], "")
                self.until = args[1] if len(args) > 1 else "."
        elif name in ("ds", "ds1", "as", "as1"):
            self._define_string(name, rest)
        elif name == "tr":
            self._translation(rest)
        elif name in self.macros:
            effect = self.macros[name]
            if effect == "nf":
                self._break()
                self.nofill = True
            elif effect == "fi":
                self.nofill = False
            elif effect == "break":
                self._break()
        # Anything else (.TH, .br, .in, .ft, .UR, .PD, an unknown macro, ...) carries no prose.

    # ------------------------------------------------------------ conditionals

    def _conditional(self, name: str, rest: str) -> None:
        if name == "el":
            true = not self.else_stack.pop() if self.else_stack else False
            body = rest.lstrip()
        else:
            true, body = self._condition(rest)
            if name == "ie":
                self.else_stack.append(true)
        block = body.startswith("\\{")
        if block:
            body = body[2:].lstrip()
        if true:
            if body:
                self.feed(body)
        elif block:
            self.false_depth = 1 + body.count("\\{") - body.count("\\}")

    def _condition(self, rest: str) -> tuple[bool, str]:
        """A condition as a terminal rendering by groff sees it, and the body after it."""
        rest = rest.lstrip()
        negate = rest.startswith("!")
        if negate:
            rest = rest[1:]
        if rest[:1] in ("n", "t", "o", "e", "v") and (len(rest) == 1 or not rest[1].isalnum()):
            value, body = rest[0] in ("n", "o"), rest[1:]
        elif rest[:2] in ("d ", "r ", "m ", "c "):
            parts = rest[2:].lstrip().split(None, 1)
            defined = bool(parts) and (parts[0] in self.strings or parts[0] in self.macros)
            value = defined if rest[0] == "d" else rest[0] == "c"
            body = parts[1] if len(parts) > 1 else ""
        else:
            parts = rest.split(None, 1)
            # groff (\n(.g) is the one numeric condition a page's text depends on; others are
            # layout.
            value = bool(parts) and parts[0] in ("\\n(.g", "\\n[.g]")
            body = parts[1] if len(parts) > 1 else ""
        return value != negate, body.lstrip()

    # ------------------------------------------------------------ definitions

    def _define_string(self, name: str, rest: str) -> None:
        parts = rest.lstrip().split(None, 1)
        if not parts:
            return
        value = parts[1] if len(parts) > 1 else ""
        if value.startswith('"'):
            value = value[1:]
        if name.startswith("as"):
            value = self.strings.get(parts[0], "") + value
        self.strings[parts[0]] = value

    def _translation(self, rest: str) -> None:
        glyphs = [
            self.render(match.group(0))
            for match in re.finditer(r"\\(?:\(..|\[[^\]]*\]|.)|[^\s\\]", rest.strip())
        ]
        for source, target in zip(glyphs[0::2], glyphs[1::2]):
            if len(source) == 1:
                self.translate[ord(source)] = target

    # ------------------------------------------------------------ text

    def render(self, text: str, depth: int = 0) -> str:
        """Text with its escapes replaced by what they print (strings expanded), or removed."""
        if "\\" in text:
            text = _ESCAPE.sub(lambda match: self._escape(match, depth), text)
        return text.translate(self.translate) if self.translate else text

    def _escape(self, match: re.Match, depth: int) -> str:
        groups = match.groupdict()
        if groups["one"] is not None:
            return _ONE.get(groups["one"], "")
        glyph = groups["glyph2"] or groups["glyph"]
        if glyph is not None:
            return _named_glyph(glyph)
        string = groups["string2"] or groups["string"] or groups["string1"]
        if string is not None:
            if depth >= _MAX_STRING_DEPTH or string not in self.strings:
                return ""
            return self.render(self.strings[string], depth + 1)
        if groups["delimited"] == "N":  # \N'233': the character of that code
            return _character(int(groups["arg"])) if groups["arg"].isdigit() else ""
        if groups["delimited"] == "C":
            return _named_glyph(groups["arg"])
        return ""  # fonts, sizes, motions, registers, colours and the like print nothing

    def _heading(self, heading: str, level: str) -> None:
        if level == "SH":
            self.skip_section = heading.strip().upper() in SKIPPED_SECTIONS

    def _text(self, text: str) -> None:
        if self.heading_next:
            self._heading(text, self.heading_next)
            self.heading_next = False
            return
        if self.nofill or self.skip_section:
            self.tag_next = False
            return
        if text.strip():
            self.current.append(text)
        if self.tag_next:
            self.tag_next = False
            self._break()

    def _break(self) -> None:
        if not self.current:
            return
        text = " ".join(self.current).replace(_JOIN + " ", "").replace(_JOIN, "")
        self.current = []
        text = " ".join(text.split())
        if not text:
            return
        if len(text.split()) < self.min_words:
            self.stats["short_paragraphs"] += 1
            return
        # a shell command outside a no-fill block (the gcloud pages' examples)
        if text.startswith("$ "):
            self.stats["command_examples"] += 1
            return
        self.paragraphs.append(text)

    def finish(self) -> list[str]:
        if self.mdoc:
            self.stats["mdoc_pages_skipped"] += 1
            return []
        self._break()
        if self.so_only and not self.content:
            self.stats["so_redirects"] += 1
            return []
        self.stats["pages"] += 1
        return self.paragraphs
