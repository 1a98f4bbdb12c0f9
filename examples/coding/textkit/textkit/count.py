"""Counting things in text."""

VOWELS = "aeiou"


def word_count(text):
    """Number of whitespace-separated words."""
    return len(text.split())


def vowel_count(text):
    """Number of vowels (a, e, i, o, u; either case)."""
    total = 0
    for ch in text.lower():
        if ch in VOWELS:
            total += 1
    return total


def longest_word(text):
    """The longest word (letters only, punctuation stripped); the first one on a tie; '' for none."""
    best = ""
    for word in text.split():
        word = "".join(ch for ch in word if ch.isalpha())
        if len(word) > len(best):
            best = word
    return best


def char_histogram(text, top=3):
    """The ``top`` most frequent letters (lower-cased) as (letter, count) pairs, most frequent first,
    ties in alphabetical order."""
    counts = {}
    for ch in text.lower():
        if ch.isalpha():
            counts[ch] = counts.get(ch, 0) + 1
    ranked = sorted(counts.items(), key=lambda item: (-item[1], item[0]))
    return ranked[:top]
