"""docs/reference/booking-convention.md, generated from the booking convention's own table and reader.

    python tools/convention_reference.py            # print the page
    python tools/convention_reference.py --write    # write docs/reference/booking-convention.md
    python tools/convention_reference.py --check    # exit 1, saying so, when the page is stale

The keys come from `gpubook.scheduler.core.convention.KEYS` and every example's outcome is what the
reader itself makes of it, so the page cannot promise what the parser does not do;
tests/test_convention_words.py runs --check's comparison.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run as a script from a checkout

from gpubook.scheduler.core import convention  # noqa: E402 - after the path it is found on
from gpubook.scheduler.core.convention import CLOSE, KEYS, MAX_GUESSES, Refused  # noqa: E402
from tools import reference_page  # noqa: E402

PAGE = ROOT / "docs" / "reference" / "booking-convention.md"
USERS = ("alice", "bob")
TEMPLATES = ("debian-ssh", "pytorch-cuda12")
HOST = "gpu1"

HEAD = """# Booking convention reference

How gpubook reads who books, which template and which GPUs from a calendar event, generated from
the parser's own table and reader (`gpubook/scheduler/core/convention.py`) by
`tools/convention_reference.py` (`python tools/convention_reference.py --write`;
`tests/test_convention_words.py` fails when this page is stale). The guide for bookers is
[Booking GPU time](../guides/booking.md#the-booking-convention).

Every word gpubook reads is understood, or the booking is refused with a sentence that names it:
nothing the booker wrote is replaced by a default.

## Keys

| key | also written | value | example |
|---|---|---|---|
"""

RULES = f"""
## One grammar, in the description and in the title

- **The description**: one `key: value` per line, anywhere in it. Plain text or HTML (Google
  Calendar, Outlook's `X-ALT-DESC`): a line is what the booker sees (`<br>`, paragraphs,
  `&nbsp;` as a blank). gpubook's own block (`--- gpubook ---`) is never read.
- **The title** (short form): `key=value` words (`gpus=2`, `user=alice`, `gpus: 2` too), and any
  word that is a known user's or template's name (`alice pytorch-cuda12 gpus=2`). Other words
  are the booker's own. A list goes on over a blank after its comma (`gpus=0, 2`).
- A key is read in any case (`GPUS`, `Gpus`), with `:` or `=` (`gpus = 2`), singular or plural
  (`gpu: 2`, `node: 2`, `users: alice`). In the description, a `#` after a blank starts a comment
  (`gpus: 2 # both`).
- User and template names are read in any case when the name is a known one (`User: Alice` is
  `alice`). A name that is not known is read as written and must follow the name rules (lower-case
  ASCII, no look-alike letters, no control characters, nothing that NFKC would change).
- The description wins over the title, the title over the location; the same key twice with
  two values in one place is refused.
- **A misspelt key** (`tempalte: x`, `gpsu: 2`, `usr: bob`) is refused with "did you mean
  `template:`?": a word is taken for a key when Python's `difflib` finds it at least {CLOSE:g}
  alike to one of the key's spellings **and** its value is one the key could take (a name, a GPU
  list, a number). So `note: rerun with lr 0.1`, `Goal: train the model` and
  `https://…` are the booker's own text, ignored without error. The first {MAX_GUESSES} such
  words of the description (and of the title) are looked at, and the first misspelt one is named.
- **A name close to a known one** (`user: Alcie`, `template: pytorch-cuda11`) is refused with
  "did you mean alice?" ({CLOSE:g} alike, the same measure); a name close to none is left to the
  plan, which refuses names that are not configured.

## Projects

- `project: vision` names the group (`[groups.NAME]`) the booking counts against; it must be one
  of the booker's groups, else the booking is refused with their groups. A group name close to a
  configured one (`project: visoin`) is refused with "did you mean vision?". Without `project:`
  the booking counts against the booker's first group (none: no group's quotas).
- Only a server with `[groups.NAME]` tables reads `project:`: without any, `project: x` (and a
  word close to it) is the booker's own text, as before groups were made.

## GPUs

- A number is a count: `gpus: 2` asks for two GPUs, and gpubook picks free ones.
- Indices are a list: `0,2`, a range `0-3`, both `0-2,5`; they are sorted, and a GPU named twice
  (`0,0`, `0-2,1`) or a range that runs backwards (`3-1`) is refused.
- `1,`, one number with a comma after it, is the list of one index: GPU 1 alone, in the title
  (`gpus=1,`) as in the description (`gpus: 1,`). It is how the booking guide has always named one GPU;
  a list reads the same wherever it is written, and the accepted event names the GPUs taken, so a
  comma meant otherwise shows at once. For one GPU that gpubook picks, write `gpus: 1`.
- On a Slurm cluster a booking asks for a count only; `nodes: K` spreads it evenly over K nodes.

## In the location

Booking systems that publish the resource as the location, and gpubook's own availability feed
(`free.ics`: `devbox1 GPU 0,1`), name GPUs there: `gpu 1`, `GPU0,GPU2`, `GPUs 0-3`, `devbox1-gpu2`.
A word that is this server's whole name (`[host] name`) is a name, never a GPU: on the server
`gpu1`, the location `gpu1 GPU 1` is GPU 1. A location without `gpu` is ignored.

## Examples

Read with the users {", ".join(f"`{u}`" for u in USERS)}, the templates
{", ".join(f"`{t}`" for t in TEMPLATES)} and the server `{HOST}`; what the event leaves out comes
from the organizer and `[defaults]`.

| title | description | location | read as |
|---|---|---|---|
"""

EXAMPLES = (
    ("", "user: alice\ntemplate: pytorch-cuda12\ngpus: 2", ""),
    ("", "User: Alice\nGpus: 2", ""),
    ("", "user = bob\ngpu = 0-1", ""),
    ("", "user: bob\ngpus: 0-2,5 # not 3 and 4", ""),
    ("", "user: alice\ngpus: 1,", ""),
    ("", "user: alice\nnote: rerun with lr 0.1\nGoal: beat the baseline", ""),
    ("", "user: alice\nproject: vision", ""),
    ("alice project=vision gpus=2", "", ""),
    ("", "user: alice\nprojet: vision", ""),
    ("alice pytorch-cuda12 gpus=2", "", ""),
    ("alice gpus=1,", "", ""),
    ("Bob fine-tuning gpus: 0, 2", "", ""),
    ("alice", "", "gpu1 GPU 1"),
    ("alice", "", "gpu-node-3 GPUs 0,1"),
    ("", "user: alice\ntempalte: pytorch-cuda12", ""),
    ("", "usr: bob", ""),
    ("alice gpsu=2", "", ""),
    ("", "user: Alcie", ""),
    ("", "user: bob\ntemplate: pytorch-cuda11", ""),
    ("", "user: bob\ngpus: 3-1", ""),
    ("", "user: bob\ngpus: 0,0", ""),
    ("", "user: bob\ngpus: all", ""),
)


def read_as(title: str, description: str, location: str) -> str:
    """What the parser makes of one example, in words."""
    words = convention.said(description.splitlines(), title, location, users=USERS, templates=TEMPLATES,
                            hosts=(HOST,))
    try:
        user = convention.user_of(words, USERS)
        asked = convention.asked_of(words, TEMPLATES)
    except Refused as refused:
        return f"refused: {refused.reason}"
    if asked.gpus is None:
        gpus = "the default count of GPUs"
    elif asked.gpus[1] is None:
        gpus = f"{asked.gpus[0]} GPU{'s' if asked.gpus[0] > 1 else ''}"
    else:
        indices = asked.gpus[1]
        gpus = f"GPU{'s' if len(indices) > 1 else ''} {','.join(map(str, indices))}"
    project = f", project `{words.values['project'].text}` (one of the booker's groups)" \
        if "project" in words.values else ""
    return (f"user `{user}`" if user else "the organizer's user") + ", " \
        + (f"template `{asked.template}`" if asked.template else "the default template") + ", " + gpus + project


def _cell(text: str) -> str:
    return "<br>".join(f"`{line}`" for line in text.splitlines()) if text else ""


def render() -> str:
    rows = [f"| `{key.name}` | {', '.join(f'`{s}`' for s in key.spellings if s != key.name)} | {key.value} | "
            f"`{key.example}` |" for key in KEYS]
    examples = [f"| {_cell(title)} | {_cell(description)} | {_cell(location)} | "
                f"{read_as(title, description, location)} |" for title, description, location in EXAMPLES]
    return HEAD + "\n".join(rows) + "\n" + RULES + "\n".join(examples) + "\n"


def main(argv: list[str]) -> int:
    return reference_page.main(argv, page=PAGE, render=render, script="tools/convention_reference.py")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
