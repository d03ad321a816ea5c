"""The diagnostic tools' common ending: print the report's lines and, given a path (--out),
write them there too. Imported by scripts run as `python3 tools/<script>.py`, whose directory
Python puts first on sys.path."""


def emit(lines, out=None) -> None:
    text = "\n".join(lines)
    print(text)
    if out:
        with open(out, "w") as f:
            f.write(text + "\n")
