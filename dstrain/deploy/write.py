"""Writing the output folder: all files rendered first (nothing half-written on bad input),
never into a non-empty folder without `force`."""

from pathlib import Path

from dstrain.errors import UserError


def check_out_dir(out: Path, force: bool) -> None:
    """Refuse a path that is a file, or a non-empty folder unless `force`."""
    if out.exists() and not out.is_dir():
        raise UserError(f"-o {out} is a file, not a folder", "give a folder path for -o")
    if out.is_dir() and any(out.iterdir()) and not force:
        raise UserError(
            f"-o {out} is not empty; deploy does not overwrite it",
            "choose a new folder, or add --force to overwrite the files deploy writes there",
            exit_code=1,
        )


def write_files(out: Path, files: dict[str, str], executable: set[str], force: bool) -> list[Path]:
    """Write `files` into `out` (created with its parents); returns the paths written."""
    check_out_dir(out, force)
    written = []
    try:
        out.mkdir(parents=True, exist_ok=True)
        for name, text in files.items():
            path = out / name
            path.write_text(text, encoding="utf-8")
            if name in executable:
                path.chmod(0o755)
            written.append(path)
    except OSError as exc:
        raise UserError(
            f"cannot write to {out}: {exc.strerror or exc}",
            "choose a folder you can write to with -o (or fix its permissions)",
        ) from None
    return written
