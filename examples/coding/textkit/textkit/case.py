"""Converting between the ways names and titles are written."""

SMALL_WORDS = {"a", "an", "and", "as", "at", "but", "by", "for", "in", "of", "on", "or", "the", "to"}


def _words(text):
    """Split ``text`` into words at spaces, dashes, underscores and lower-to-upper case changes."""
    words, current = [], ""
    for i, ch in enumerate(text):
        if ch in " -_":
            if current:
                words.append(current)
            current = ""
        elif ch.isupper() and i > 0 and text[i - 1].islower():
            words.append(current)
            current = ch
        else:
            current += ch
    if current:
        words.append(current)
    return words


def slugify(text, sep="-"):
    """Lower-case words of letters and digits joined by ``sep``: 'Hello, World!' -> 'hello-world'."""
    cleaned = "".join(ch if ch.isalnum() else " " for ch in text.lower())
    return sep.join(cleaned.split())


def snake_case(text):
    """'HelloWorld', 'hello-world' -> 'hello_world'."""
    return "_".join(word.lower() for word in _words(text))


def camel_case(text):
    """'hello_world' -> 'helloWorld'."""
    words = _words(text)
    if len(words) == 0:
        return ""
    return words[0].lower() + "".join(word[:1].upper() + word[1:].lower() for word in words[1:])


def title_case(text):
    """Capitalise each word except small words that are not first or last: 'the lord of the rings'
    -> 'The Lord of the Rings'."""
    words = text.split()
    out = []
    for i, word in enumerate(words):
        if 0 < i < len(words) - 1 and word.lower() in SMALL_WORDS:
            out.append(word.lower())
        else:
            out.append(word[:1].upper() + word[1:].lower())
    return " ".join(out)
