"""Values a run has seen, for narrowing a small model's arguments through the reply grammar.

A 135M model writes well-formed calls under a grammar, but it invents file names and answers. With
``SeenValues`` the grammar admits, for some parameters, only values this run has actually seen:

- a path parameter (``path``, ``file``, ``dir``, ...) of an ordinary tool: names the task mentions
  (``notes.txt``, "the ``data`` directory") and the entries ``list_dir``-like tools returned, or ".";
  a listing tool is offered only the directories among them (and "."), a reading tool only the
  files (none known yet: it is left out), and a writing tool only the files the task names that
  the run has not read (``write_targets``; with several named, only once one of them was read),
  and, for the text to write, the task's quoted strings, else the lines of the files it read that
  the task names (a summary of what was read), never an empty text; an optional parameter that is
  not text (``max_bytes``) is not offered: it keeps its default;
- a text parameter (``content``, ``text``, ...) of an ordinary tool: the quoted strings of the task;
- the text parameters of a completion tool (``complete_task(summary=...)``): the lines results
  returned, their sizes as the feedback states them ("3 entries", "4 lines"), the names and the
  task's quoted strings.

A parameter with nothing seen for it stays free. The task's wording narrows the answer further:
a question of "how many" / "count" / "number of" is answered with a size ("3 entries"), one of
"which file" with the name of a file the run has read (every file the task names, when it names
several; and one whose text shares a word with the task, unless every file seen was read), and any
other with a line a result returned; where some candidates share a word with the task (three
letters or more, not a common one), only those are offered. The completion tool is left out of the
grammar until the run has seen such an answer, so the model cannot finish before it has looked. A
tool that writes is left out when the task does not ask for writing (no "write", "save", "create",
...).

``completion_missing()`` says what a task still lacks before it can be reported done, whatever the
grammar: no tool has run yet, or the task names files and asks for writing, and none it names was
written that it did not read, or one it names was neither read nor written.
``CiaynAgent(check_completion=True)`` refuses a completion call with it (and keeps the completion
tool out of a grammar built from the specs meanwhile).

This narrows what the model may write; it never widens what the parser accepts (every choice is a
plain string literal, and a tool left out of the grammar is still a valid call). It is only used when
asked for (``CiaynAgent(constrain_values=True)``, part of the small-model options).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from controller.prompts import completion_tools
from protocol import Call, Result, ToolSpec

MAX_CHOICES = 48  # per parameter; the newest values are kept
MAX_VALUE_CHARS = 160  # longer lines are not offered as whole-value choices
_PATH_PARAM = re.compile(r"path|file|dir|folder", re.IGNORECASE)
_TEXT_PARAM = re.compile(r"content|text|body|data", re.IGNORECASE)
_FILE_NAME = re.compile(r"(?<![\w/.-])((?:[\w-]+/)*[\w-]+\.[A-Za-z0-9]{1,8})(?![\w/])")
# Directory names a task gives in words: "the data directory", "the directory data", "list data".
_DIR_WORDS = (
    re.compile(r"\b([\w.-]+)/?\s+(?:directory|folder|dir)\b", re.IGNORECASE),
    re.compile(r"\b(?:directory|folder)\s+([\w./-]+)", re.IGNORECASE),
    re.compile(r"\blist\s+(?:the\s+)?([\w./-]+)", re.IGNORECASE),
)
_NOT_NAMES = frozenset(
    (
        "the", "a", "an", "this", "that", "it", "its", "workspace", "directory", "folder", "files", "entries",
        "and", "or", "with", "to", "of", "in", "on", "for", "is", "has", "have", "then", "call",
    )
)
_QUOTED = re.compile(r"'([^'\n]{1,160})'|\"([^\"\n]{1,160})\"")
_COUNT_QUESTION = re.compile(r"\bhow many\b|\bcount\b|\bnumber of\b", re.IGNORECASE)
# asks for a file (not a line): "which file", "which of a.txt and b.txt", "the name of the file"
_NAME_QUESTION = re.compile(
    r"\bwhich\s+(?:\w+\s+)?(?:file|document)s?\b|\bwhich\s+(?:one|of)\b|\bname of\b|\bfile ?name\b"
    r"|\b(?:its|the|their)\s+names?\b|\bthe\s+(?:file|document)s?\s+(?:that|which|where)\b",
    re.IGNORECASE,
)
_WRITE_WORDS = re.compile(r"\b(?:write|writes|save|create|put|make|store|append|overwrite)\b", re.IGNORECASE)
_WRITER_TOOL = re.compile(r"write|save|create|append|delete|remove", re.IGNORECASE)
_READER_TOOL = re.compile(r"read|cat$|open|view|show", re.IGNORECASE)
_LISTER_TOOL = re.compile(r"list|ls$|dir", re.IGNORECASE)
_SIZE = re.compile(r"^\d+ (?:entry|entries|line|lines)$")
_LINES_QUESTION = re.compile(r"\blines?\b", re.IGNORECASE)
_WORD = re.compile(r"[A-Za-z][A-Za-z-]{2,}")
_COMMON = frozenset(
    (
        # words of any task about files, and English function words: they relate nothing to anything
        "that", "this", "with", "from", "then", "them", "what", "which", "where", "when", "does", "have", "call",
        "read", "list", "open", "show", "find", "tell", "report", "finish", "file", "files", "name", "line",
        "lines", "text", "number", "count", "many", "entries", "entry", "directory", "folder", "about", "into",
        "your", "using", "there", "their", "write", "save", "create", "make", "the", "and", "for", "its", "one",
        "all", "any", "are", "but", "can", "did", "get", "has", "how", "may", "not", "now", "off", "out", "own",
        "put", "say", "see", "she", "too", "use", "was", "way", "who", "why", "you", "her", "him", "his", "our",
        "they", "these", "those", "will", "would", "should", "could", "must", "also", "only", "each", "every",
        "some", "than", "here", "just", "like", "said", "says", "mention", "mentions", "mentioned", "contain",
        "contains", "containing", "talks", "talk", "written", "word", "words", "give", "gives", "look", "please",
        "task", "complete", "completed", "done", "summary", "summarise", "summarize", "result", "answer",
        "value", "first", "last", "next", "other", "both", "either", "whether", "tool", "tools", "workspace",
    )
)
MAX_READ_CHARS = 4000  # of a file's text kept to match task words against


def _add(values: list[str], items: Iterable[str]) -> None:
    for item in items:
        item = item.strip()
        if item and len(item) <= MAX_VALUE_CHARS and "\x00" not in item:
            if item in values:
                values.remove(item)
            values.append(item)
    del values[:-MAX_CHOICES]


@dataclass
class SeenValues:
    """What a run has seen so far; ``constrain(specs)`` gives specs whose schemas say so (``enum``)."""

    names: list[str] = field(default_factory=list)
    quoted: list[str] = field(default_factory=list)
    lines: list[str] = field(default_factory=list)
    read: dict[str, str] = field(default_factory=dict)  # files whose text was returned: name -> text
    listed_files: list[str] = field(default_factory=list)  # entries listings returned that are not directories
    dirs: list[str] = field(default_factory=list)  # directories: the task's, and those listings returned
    wrote: list[str] = field(default_factory=list)  # paths a writing tool wrote successfully
    sources: list[str] = field(default_factory=list)  # files read before the run wrote them (if it did)
    task_names: list[str] = field(default_factory=list)  # file names the task mentions
    task_dirs: list[str] = field(default_factory=list)  # directory names it gives in words
    sizes_of: dict[str, str] = field(default_factory=dict)  # listed path -> its size ("3 entries")
    task_words: frozenset[str] = frozenset()
    task_tokens: frozenset[str] = frozenset()  # every word of the task, lower case (directory names, say)
    answer: str = "any"  # what the task asks for: "count", "name" or "any"
    unit: str = "entries"  # what a count counts: "entries" (of a directory) or "lines" (of a file)
    lines_of: dict[str, str] = field(default_factory=dict)  # read file -> its size ("4 lines")
    writes: bool = True  # whether the task asks for writing
    succeeded: int = 0
    version: int = 0

    @classmethod
    def from_task(cls, task: str) -> SeenValues:
        seen = cls()
        if _COUNT_QUESTION.search(task):
            seen.answer = "count"
            seen.unit = "lines" if _LINES_QUESTION.search(task) else "entries"
        elif _NAME_QUESTION.search(task):
            seen.answer = "name"
        seen.writes = bool(_WRITE_WORDS.search(task))
        seen.task_words = frozenset(w.lower() for w in _WORD.findall(task)) - _COMMON
        seen.task_tokens = frozenset(w.strip(".-").lower() for w in re.findall(r"[\w.-]+", task))
        files = [m.group(1) for m in _FILE_NAME.finditer(task)]
        dirs = [m.group(1).rstrip("/.") for pattern in _DIR_WORDS for m in pattern.finditer(task)]
        dirs = [d for d in dirs if d and d.lower() not in _NOT_NAMES and d not in files]
        _add(seen.names, [*files, *dirs])
        seen.task_names = list(dict.fromkeys(files))
        seen.task_dirs = list(dict.fromkeys(dirs))
        _add(seen.dirs, seen.task_dirs)
        _add(seen.quoted, [m.group(1) or m.group(2) for m in _QUOTED.finditer(task)])
        return seen

    def add_result(self, result: Result, call: Call | None = None) -> None:
        """Remember what a successful result showed: entries of a list, lines of a text, sizes, and
        (given the call) the name of a file whose text it returned."""
        if not result.ok:
            return
        self.version += 1
        self.succeeded += 1
        value: Any = result.value
        named = [v for v in [*call.args, *call.kwargs.values()] if isinstance(v, str)] if call is not None else []
        if call is not None and isinstance(value, str) and _READER_TOOL.search(call.tool) and named:
            self.read[named[0]] = value[:MAX_READ_CHARS]
            if named[0] not in self.wrote:  # reading back what the run wrote makes it no source
                _add(self.sources, named[:1])
            count = len(value.splitlines())
            self.lines_of[named[0]] = f"{count} {'line' if count == 1 else 'lines'}"
        if call is not None and _WRITER_TOOL.search(call.tool) and named:
            _add(self.wrote, named[:1])
        if isinstance(value, dict):  # e.g. run_shell: its text fields
            value = "\n".join(v for v in value.values() if isinstance(v, str))
        if isinstance(value, list):
            where = (named[0] if named else ".").strip("/") or "."
            here = "" if where in (".", "./") else f"{where}/"  # entries are relative to the listed directory
            entries = [here + v for v in value if isinstance(v, str)]
            _add(self.names, [*entries, *(e.rstrip("/") for e in entries if e.endswith("/"))])
            _add(self.listed_files, [e for e in entries if not e.endswith("/")])
            subdirs = [e.rstrip("/") for e in entries if e.endswith("/")]
            _add(self.dirs, subdirs)
            # a directory the task names as a bare word ("the entries of archive") is one it means
            mentioned = [d for d in subdirs if d.lower() in self.task_tokens]
            self.task_dirs = list(dict.fromkeys([*self.task_dirs, *mentioned]))
            size = f"{len(value)} {'entry' if len(value) == 1 else 'entries'}"
            _add(self.lines, [size])
            self.sizes_of[where] = size
        elif isinstance(value, str):
            lines = value.splitlines()
            _add(self.lines, lines)
            if len(lines) > 1:
                _add(self.lines, [f"{len(lines)} lines"])

    def constrain(self, specs: Sequence[ToolSpec]) -> list[ToolSpec]:
        """Copies of ``specs`` whose path, text and completion parameters admit only seen values,
        without the completion tool before an answer was seen and without writing tools when the task
        does not ask for writing (all of ``specs`` if that would leave none)."""
        finishers = set(completion_tools(specs))
        out = []
        for spec in specs:
            role = _role(spec.name, finishers)
            if role == "finish" and not self.answer_ready():
                continue
            if role == "write" and (not self.writes or not self._may_write()):
                continue
            properties = dict(spec.parameters.get("properties") or {})
            changed, callable_ = False, True
            for p in spec.params:
                schema = properties.get(p.name)
                if p.kind.startswith("var_") or not isinstance(schema, dict) or schema.get("type") != "string":
                    continue
                choices = self._choices(p.name, role)
                if choices:
                    properties[p.name] = {**schema, "enum": choices}
                    changed = True
                elif role == "write" and _TEXT_PARAM.search(p.name) and not _PATH_PARAM.search(p.name):
                    properties[p.name] = {**schema, "minLength": 1}  # writing nothing is no writing
                    changed = True
                elif choices is None and p.required:
                    callable_ = False  # nothing it could be called with is known yet
            if not callable_:
                continue
            kept = [p for p in spec.params if p.required or (properties.get(p.name) or {}).get("type") == "string"]
            if changed or len(kept) < len(spec.params):  # other optional parameters keep their defaults
                parameters = {**spec.parameters, "properties": properties}
                spec = spec.model_copy(update={"parameters": parameters, "params": kept})
            out.append(spec)
        return out or list(specs)

    def _sizes(self) -> list[str]:
        """The sizes seen of what the question counts (lines of a file, or entries of a directory);
        only those of the files or directories the task names, when it names some and one was seen."""
        if self.unit == "lines":
            named = [self.lines_of[n] for n in self.task_names if n in self.lines_of]
            return _unique(named or list(self.lines_of.values()))
        named = [self.sizes_of[d] for d in self.task_dirs if d in self.sizes_of]
        return named or [line for line in self.lines if _SIZE.match(line) and "entr" in line]

    def completion_missing(self) -> str | None:
        """What the task still lacks before it can be reported done, as a clause for the model
        (``"nothing has been written yet"``), or None when nothing is known to be missing: no tool
        has run, or the task names a file and asks for writing and no writing tool succeeded."""
        if self.succeeded == 0:
            return "no tool has run yet, so nothing of the task has been done"
        if not (self.writes and self.task_names):
            return None
        if self.needs_writing():
            return f"the task asks for writing {' or '.join(self.write_targets())} and it has not been written yet"
        unseen = [n for n in self.task_names if n not in self.sources and n not in self.wrote]
        if unseen:
            return f"the task names {' and '.join(unseen)}, which has not been read yet"
        return None

    def needs_writing(self) -> bool:
        """Whether a writing task that names files has written none of them that it did not read first."""
        return not [n for n in self.task_names if n in self.wrote and n not in self.sources]

    def write_targets(self) -> list[str]:
        """The files a writing task may mean: those it names that the run did not read before
        writing them (all it names when it read them all first)."""
        unread = [n for n in self.task_names if n not in self.sources]
        return unread or list(self.task_names)

    def write_target(self) -> str:
        """The likeliest of ``write_targets``: one already written, else the last."""
        targets = self.write_targets()
        return next((t for t in targets if t in self.wrote), (targets or ["the file"])[-1])

    def _may_write(self) -> bool:
        """A task naming several files writes after reading one (what it writes comes from there)."""
        return len(self.task_names) < 2 or any(n in self.sources for n in self.task_names)

    def answer_ready(self) -> bool:
        """Whether the run has seen what the task asks for (then the completion tool is offered)."""
        if self.completion_missing() is not None:
            return False
        if self.answer == "count":
            if self.unit == "lines" and self.task_names:
                return any(n in self.lines_of for n in self.task_names)
            named = [d for d in self.task_dirs if d in self.sizes_of]
            return bool(named) if self.task_dirs and self.unit == "entries" else bool(self._sizes())
        if self.answer == "name":
            wanted = set(self.task_names) if len(self.task_names) > 1 else set()
            if not self.read or not wanted <= set(self.read):
                return False
            # a file related to the task was read, or there is nothing left to read
            unread = set(self.task_names or self.listed_files) - set(self.read)
            return not unread or any(self._related(text) for text in self.read.values())
        if self.task_names and not self.writes:  # a question about named files: read one first
            return bool(set(self.task_names) & set(self.read))
        return True
    def _related(self, text: str) -> bool:
        return bool(self.task_words & {w.lower() for w in _WORD.findall(text)})

    def _choices(self, param: str, role: str) -> list[str] | None:
        """The values a parameter may take: [] when it stays free, None when nothing it could take
        is known yet (a file to read before any is named or listed)."""
        if role == "finish":
            if self.answer == "count" and self._sizes():
                return self._sizes()
            if self.answer == "name" and self.read:
                related = [name for name, text in self.read.items() if self._related(text)]
                return related or list(self.read)
            related = [line for line in self.lines if self._related(line)]
            return related or _unique([*self.lines, *self.quoted, *self.names])
        if _PATH_PARAM.search(param):
            if role == "write" and self.task_names:  # what the task names, never a file it was read from
                return self.write_targets()
            if role == "list":
                return _unique([d for d in self.names if d in self.dirs] + ["."])
            if role == "read":  # files only; those the task names first, while some are not read
                files = [n for n in self.names if n not in self.dirs and not n.endswith("/") and n != "."]
                named = [n for n in self.task_names if n not in self.read]
                return named or files or None
            return _unique([*self.names, "."])
        if _TEXT_PARAM.search(param):
            if role == "write" and not self.quoted:  # what to write comes from what the task had read
                return self._source_lines()
            return list(self.quoted)
        return []

    def _source_lines(self) -> list[str]:
        """The lines of the files the run read that the task names (its sources), else of any file read."""
        named = [text for name, text in self.read.items() if name in self.task_names and name in self.sources]
        sources = named or list(self.read.values())
        return _unique([line.strip() for text in sources for line in text.splitlines() if line.strip()])


def _role(name: str, finishers: set[str]) -> str:
    """What a tool does, by its name: finish, write, list, read or other."""
    if name in finishers:
        return "finish"
    for role, pattern in (("write", _WRITER_TOOL), ("list", _LISTER_TOOL), ("read", _READER_TOOL)):
        if pattern.search(name):
            return role
    return "other"


def _unique(values: list[str]) -> list[str]:
    return list(dict.fromkeys(values))[-MAX_CHOICES:]
