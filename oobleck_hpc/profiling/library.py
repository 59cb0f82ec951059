"""The profile library: a directory tree of HDF5 profile files that jobs, people and other
centres share.

Layout: `<library>/<model>/<device>/<dtype>-mb<k>.h5` (`library_path`, `library_path_for`).
`list_library` loads every file (bad ones listed with their error); `import_profiles` copies the
valid profiles of another library (or one file) in, each to its canonical name, and never
overwrites a different existing file: identical content is skipped, different content is
refused (or kept beside it under a suffixed name with `keep-both`), and each case is reported.
The files themselves (format, checksum, durable writes) are store.py's business.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from oobleck_hpc.errors import ProfileError
from oobleck_hpc.profiling.profile import Fingerprint, ModelProfile
from oobleck_hpc.profiling.store import (
    SUFFIX,
    copy_profile,
    load_profile,
    profile_checksum,
    stored_checksum,
)


# ----------------------------------------------------------------------------- paths


def safe_name(text: str) -> str:
    """A file-system safe path component: keeps letters, digits, '.', '_' and '-'."""
    out = re.sub(r"[^A-Za-z0-9._-]+", "-", text.strip()).strip("-.")
    return out or "unnamed"


def library_path(library_dir: str | Path, fingerprint: Fingerprint) -> Path:
    """`<library>/<model>/<device>/<dtype>-mb<k>.h5` for the profile a fingerprint describes."""
    return (Path(library_dir) / safe_name(fingerprint.model_name) / safe_name(fingerprint.device_name)
            / f"{safe_name(fingerprint.dtype)}-mb{fingerprint.microbatch_size}{SUFFIX}")


def library_path_for(library_dir: str | Path, model: str, device: str, dtype: str,
                     microbatch_size: int) -> Path:
    """`library_path` from the four names that choose a file (before a fingerprint exists)."""
    return (Path(library_dir) / safe_name(model) / safe_name(device)
            / f"{safe_name(dtype)}-mb{microbatch_size}{SUFFIX}")


# ----------------------------------------------------------------------------- library


@dataclass(frozen=True)
class LibraryEntry:
    path: Path
    profile: ModelProfile | None
    error: str | None = None
    """Set (and `profile` None) when the file fails verification."""


def profile_files(library_dir: str | Path) -> list[Path]:
    """Every profile file under a library directory (sorted; temporary files are skipped)."""
    root = Path(library_dir)
    if root.is_file():
        return [root]
    if not root.is_dir():
        raise ProfileError(f"profile library {root} is not a directory. Fix: pass an existing "
                           f"directory (the repository ships one in profiles/)")
    return sorted(p for p in root.rglob(f"*{SUFFIX}") if not p.name.startswith("."))


def list_library(library_dir: str | Path) -> list[LibraryEntry]:
    """Load every profile file under `library_dir`; bad files are listed with their error."""
    entries = []
    for p in profile_files(library_dir):
        try:
            entries.append(LibraryEntry(p, load_profile(p)))
        except ProfileError as e:
            entries.append(LibraryEntry(p, None, str(e)))
    return entries


@dataclass
class ImportReport:
    """What `import_profiles` did with each source file."""

    imported: list[tuple[Path, Path]] = field(default_factory=list)
    """(source, destination) newly written."""
    identical: list[tuple[Path, Path]] = field(default_factory=list)
    """Destination already held the same profile (same checksum): nothing written."""
    kept_both: list[tuple[Path, Path]] = field(default_factory=list)
    """Destination held a different profile; the source was stored beside it under this name."""
    refused: list[tuple[Path, Path]] = field(default_factory=list)
    """Destination held a different profile; nothing written (policy 'refuse')."""
    invalid: list[tuple[Path, str]] = field(default_factory=list)
    """Source files that failed verification; not imported."""

    @property
    def ok(self) -> bool:
        return not self.refused and not self.invalid

    def lines(self) -> list[str]:
        out = [f"imported   {s} -> {d}" for s, d in self.imported]
        out += [f"identical  {s} == {d} (skipped)" for s, d in self.identical]
        out += [f"kept both  {s} -> {d} (a different profile already has the canonical name)"
                for s, d in self.kept_both]
        out += [f"REFUSED    {s}: {d} exists with a different profile (use --keep-both to store "
                f"both, or remove {d} first)" for s, d in self.refused]
        out += [f"INVALID    {s}: {e}" for s, e in self.invalid]
        return out


def import_profiles(src: str | Path, dst: str | Path,
                    on_conflict: Literal["refuse", "keep-both"] = "refuse") -> ImportReport:
    """Copy every valid profile under `src` (a file or a library directory) into the library
    `dst`, each to its canonical `library_path`. Never overwrites a different file: identical
    profiles are skipped, different ones refused or (keep-both) stored as
    `<dtype>-mb<k>.<checksum12>.h5` beside the existing one. Safe when several processes import
    into the same library at once: every published file is complete and verified."""
    report = ImportReport()
    dst = Path(dst)
    for s in profile_files(src):
        try:
            profile = load_profile(s)
        except ProfileError as e:
            report.invalid.append((s, str(e)))
            continue
        checksum = profile_checksum(profile)
        dest = library_path(dst, profile.fingerprint)
        for _ in range(3):  # an existing file may vanish between the link attempt and the compare
            published = copy_profile(s, dest, overwrite=False)
            if published:
                report.imported.append((s, dest))
                break
            try:
                existing = stored_checksum(dest)
            except FileNotFoundError:
                continue
            except ProfileError:
                existing = None  # a damaged existing file is a different file: never replaced here
            if existing == checksum:
                report.identical.append((s, dest))
            elif on_conflict == "keep-both":
                alt = dest.with_name(f"{dest.stem}.{checksum[:12]}{SUFFIX}")
                published = copy_profile(s, alt, overwrite=False)
                if published:
                    report.kept_both.append((s, alt))
                else:
                    report.identical.append((s, alt))  # same checksum name: same content
            else:
                report.refused.append((s, dest))
            break
    return report
