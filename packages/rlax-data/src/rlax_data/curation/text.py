"""Text views of records shared by the curation passes.

A text is read as a sequence of tokens: numbers (`3.5`, `1,000`, `9,8,2`), words, and
single symbols (`+ - * / = ^ ( ) < > \\ { }` ...). Only prose punctuation that never
changes a problem's answer (`, ; : ! ? " '` and a full stop outside a number) is
dropped, and `!` and `'` are kept where they follow an operand (`5!`, `f'(x)`); every
digit, operator and variable stays, so "808-414=" and "808+414=" remain different texts.
"""

from __future__ import annotations

import re
import unicodedata

from rlax_data.datasets import Record

__all__ = ["answer_key", "normalize_text", "prose_words", "record_text", "text_tokens"]

# A LaTeX command is one token (`\frac` and `\sqrt` are operators); a number keeps its
# inner separators ("3.5" is not "35", "9,8,2" is not "982"); a word is a run of letters;
# anything else that is not a space is one symbol token.
_TOKEN = re.compile(r"\\[^\W\d_]+|\d+(?:[.,:]\d+)*|[^\W\d_]+|\S", re.UNICODE)
# Punctuation of prose: dropping it never changes what a problem asks ...
_PROSE_PUNCT = frozenset(",;:!?.\"'`“”‘’«»…¿¡")
# ... except these right after an operand: a factorial (`5!`, `n!`) or a prime (`f'(x)`).
_POSTFIX_OPERATORS = frozenset("!'’")


def record_text(record: Record) -> str:
    """The prompt text, or the chat messages' contents joined by newlines."""
    if record.prompt is not None:
        return record.prompt
    return "\n".join(m.content for m in record.messages or [])


def text_tokens(text: str) -> list[str]:
    """NFKC, lowercased tokens of `text` with prose punctuation removed (numbers, words,
    operators and other symbols kept, in order)."""
    s = unicodedata.normalize("NFKC", text).lower()
    tokens = []
    for m in _TOKEN.finditer(s):
        token = m.group()
        if token not in _PROSE_PUNCT or (token in _POSTFIX_OPERATORS and _follows_operand(s, m.start())):
            tokens.append(token)
    return tokens


def _follows_operand(s: str, at: int) -> bool:
    """Whether s[at] comes right after a digit, a closing bracket or a single letter
    (a variable), where `!` and `'` are operators; after a word they are punctuation."""
    before = s[at - 1] if at > 0 else " "
    if before.isdigit() or before in ")]}":
        return True
    return before.isalpha() and not (at > 1 and s[at - 2].isalpha())


def normalize_text(text: str) -> str:
    """What "the same text" means: the tokens joined by single spaces. Case, spacing and
    prose punctuation do not count; digits, operators and variables do."""
    return " ".join(text_tokens(text))


# Words that decide an answer as surely as a digit or an operator does: numbers and
# operations written out, comparisons, parity and negation. "The larger of the two" and
# "the smaller of the two" differ in one word of many, which MinHash alone would merge.
_ANSWER_WORDS = frozenset(
    """
    zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen
    fifteen sixteen seventeen eighteen nineteen twenty thirty forty fifty sixty seventy
    eighty ninety hundred hundreds thousand thousands million millions billion billions
    dozen dozens half halves third thirds quarter quarters fifth fifths tenth tenths
    first second fourth sixth seventh eighth ninth last once twice thrice double triple
    sum plus add adds added adding total difference minus subtract subtracts subtracted
    less fewer more product times multiply multiplies multiplied quotient divide divides
    divided remainder modulo mod square squared squares cube cubed cubes root roots power
    powers exponent percent percentage average mean median mode
    larger largest smaller smallest greater greatest bigger biggest lesser least most
    higher highest lower lowest longer longest shorter shortest maximum minimum max min
    increase increased increases decrease decreased decreases
    odd even prime positive negative not no never none without except
    sin cos tan cot sec csc arcsin arccos arctan sinh cosh tanh log ln exp sqrt floor ceil
    gcd lcm abs det derivative derivatives integral integrals limit limits
    area perimeter volume circumference radius diameter
    """.split()
)


def _is_prose_word(token: str) -> bool:
    # Words of two or more letters carry the wording, unless they name a number, an
    # operation or a comparison; a single letter is read as a variable ("x", "n"), so it
    # decides the answer like a number does (and so does a LaTeX command, "\frac").
    return len(token) > 1 and token.isalpha() and token not in _ANSWER_WORDS


def answer_key(text: str) -> tuple[str, ...]:
    """The tokens that decide a problem's answer, in order: numbers, symbols (operators,
    brackets, relations), single-letter variables, and words naming a number, an
    operation or a comparison. Two texts whose keys differ pose different problems
    however similar their wording is."""
    return tuple(t for t in text_tokens(text) if not _is_prose_word(t))


def prose_words(text: str) -> list[str]:
    """The remaining tokens (the other words of two or more letters), in order: the wording."""
    return [t for t in text_tokens(text) if _is_prose_word(t)]
