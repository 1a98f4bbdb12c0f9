"""Held-back inputs for each textkit function: never copied into a rollout's working copy. The grader
calls them on the agent's code and on the clean package and compares, so code that only memorises the
shipped test cases still fails (grade.py)."""

HIDDEN = {
    "slugify": [("Grüße aus Köln",), ("--Already--slugged--",), ("MiXeD 42 cAsE", "+")],
    "snake_case": [("parseHTTPResponse",), ("some-mixed_Input here",), ("x",)],
    "camel_case": [("make-it-camel",), ("ALREADY_UPPER_CASE",), ("one two",)],
    "title_case": [("of mice and men",), ("the end",), ("a",), ("gone with the wind",)],
    "word_count": [("one",), ("tabs\tand\nnewlines here",), ("   ",)],
    "vowel_count": [("Programming Language",), ("xyz",), ("EUOUAE",)],
    "longest_word": [("a bb ccc dd",), ("well-known facts",), ("!!! ???",)],
    "char_histogram": [("Mississippi", 4), ("abc", 5), ("The rain in Spain", 2)],
    "ordinal": [(0,), (10,), (20,), (23,), (112,), (1001,), (1013,)],
    "human_size": [(1,), (2047,), (1024 ** 2 * 3 // 2,), (1024 ** 4,), (1024 ** 5 * 2,)],
    "roman": [(3,), (8,), (49,), (444,), (2024,), (4000,)],
    "thousands": [(0,), (12,), (123456,), (-1,), (-1234567, " ")],
    "truncate": [("hello", 3), ("hello", 0), ("hello there", 9, ".."), ("", 3)],
    "wrap": [("one two three four five six", 9), ("x", 1), ("aa bb", 2)],
    "center": [("odd", 8), ("", 3), ("abc", 3), ("ab", 7, "-")],
    "indent_lines": [("one line",), ("\n", "# "), ("a\n  \nb", "| ")],
}
