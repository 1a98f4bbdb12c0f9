"""Writing numbers for people."""

UNITS = ["B", "KB", "MB", "GB", "TB"]
NUMERALS = [(1000, "M"), (900, "CM"), (500, "D"), (400, "CD"), (100, "C"), (90, "XC"),
            (50, "L"), (40, "XL"), (10, "X"), (9, "IX"), (5, "V"), (4, "IV"), (1, "I")]


def ordinal(n):
    """1 -> '1st', 2 -> '2nd', 3 -> '3rd', 4 -> '4th', 11 -> '11th', 22 -> '22nd'."""
    if 10 <= n % 100 <= 20:
        suffix = "th"
    else:
        suffix = {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return str(n) + suffix


def human_size(size):
    """Bytes in the largest unit that keeps the number at least 1, one decimal: 1536 -> '1.5 KB'."""
    value = float(size)
    unit = 0
    while value >= 1024 and unit < len(UNITS) - 1:
        value = value / 1024
        unit += 1
    if unit == 0:
        return f"{int(value)} B"
    return f"{value:.1f} {UNITS[unit]}"


def roman(n):
    """Roman numerals for 1..3999: 1994 -> 'MCMXCIV'."""
    if n < 1 or n > 3999:
        return ""
    out = ""
    for value, numeral in NUMERALS:
        while n >= value:
            out += numeral
            n -= value
    return out


def thousands(n, sep=","):
    """Digits grouped by three: 1234567 -> '1,234,567'; negative numbers keep their sign."""
    digits = str(abs(n))
    groups = []
    while len(digits) > 3:
        groups.insert(0, digits[-3:])
        digits = digits[:-3]
    groups.insert(0, digits)
    sign = "-" if n < 0 else ""
    return sign + sep.join(groups)
