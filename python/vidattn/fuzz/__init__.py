"""Fuzzing of every op: random configurations against the float64 reference and a catalogue of bad inputs (`python -m vidattn.fuzz --help`)."""
