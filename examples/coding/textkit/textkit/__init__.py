"""textkit: small text utilities (case conversion, wrapping, counting, number formatting)."""

from textkit.case import camel_case, slugify, snake_case, title_case
from textkit.count import char_histogram, longest_word, vowel_count, word_count
from textkit.numfmt import human_size, ordinal, roman, thousands
from textkit.wrap import center, indent_lines, truncate, wrap

__all__ = ["camel_case", "slugify", "snake_case", "title_case", "char_histogram", "longest_word", "vowel_count",
           "word_count", "human_size", "ordinal", "roman", "thousands", "center", "indent_lines", "truncate", "wrap"]
