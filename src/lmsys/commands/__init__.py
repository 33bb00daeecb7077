"""Thin CLI modules, one Typer sub-app per group: parse options, call one library function, render."""
