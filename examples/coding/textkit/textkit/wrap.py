"""Laying text out in lines."""


def truncate(text, width, ellipsis="..."):
    """At most ``width`` characters; a cut text ends with ``ellipsis`` (counted in ``width``)."""
    if len(text) <= width:
        return text
    keep = width - len(ellipsis)
    if keep < 0:
        return ellipsis[:width]
    return text[:keep] + ellipsis


def wrap(text, width):
    """Greedy word wrap into lines of at most ``width`` characters (a longer word gets a line of its own)."""
    lines, line = [], ""
    for word in text.split():
        if not line:
            line = word
        elif len(line) + 1 + len(word) <= width:
            line = line + " " + word
        else:
            lines.append(line)
            line = word
    if line:
        lines.append(line)
    return lines


def center(text, width, fill=" "):
    """``text`` centred in ``width`` characters; an odd leftover goes to the right."""
    if len(text) >= width:
        return text
    total = width - len(text)
    left = total // 2
    right = total - left
    return fill * left + text + fill * right


def indent_lines(text, prefix="    ", skip_blank=True):
    """``prefix`` before each line; blank lines stay empty when ``skip_blank``."""
    out = []
    for line in text.split("\n"):
        if skip_blank and line.strip() == "":
            out.append(line)
        else:
            out.append(prefix + line)
    return "\n".join(out)
