"""Secrets out of everything gnsweep writes or prints: `***` in place of credentials.

What counts as a secret: the password of a URI (`scheme://user:PASSWORD@host`, also a bare
`scheme://TOKEN@host`), the value of any setting whose name says token, key, secret or
password (`api_key`, `auth_token`...), and in a command the value of such a flag, given as
`--api-key=VALUE` or `--api-key VALUE`. Only values are masked: gnsweep's own words
(`key=value` in a message that explains a syntax) are left as they are.

The run itself still needs the real values: the launcher hands them to its workers through the
environment (`SECRETS_ENV`, inherited by local workers, torchrun and Slurm jobs, kept by a
Slurm requeue); `restore` puts them back. So that a later `gnsweep launch DIR` or `gnsweep plan
DIR` runs the real command too, the launcher also keeps them in a file only its user can read,
outside the sweep folder (`remember`, `recall`: `SECRET_DIR`); where that file is missing (the
sweep folder copied to another machine) the launch is refused in one line.

A leaf: no gnsweep imports.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

MASK = "***"
SECRETS_ENV = "GNSWEEP_SECRETS"
"""JSON {dotted setting: real value} of the settings redacted on disk, for this launch's
workers."""

_SECRET_WORDS = ("token", "key", "secret", "password", "passwd", "credential", "credentials")
# userinfo of a URI: scheme://user:password@ or scheme://token@ (no '/' before the '@').
_URI_USERINFO = re.compile(r"(?P<scheme>[A-Za-z][A-Za-z0-9+.-]*://)(?P<user>[^/@\s:]*)"
                           r"(?::(?P<password>[^/@\s]*))?@")
# A secret passed as a query parameter: ?token=...&api_key=...
_QUERY_SECRET = re.compile(r"(?P<name>[?&;][^=&;#\s]*(?:token|key|secret|passw(?:or)?d)"
                           r"[^=&;#\s]*=)(?P<value>[^&;#\s]+)", re.IGNORECASE)
# name=value, name:value or name: "value" in free text (an error message, a Hydra override
# echoed back, JSON). After ": " only a quoted value is one: "task.password: not an option"
# is a message about the setting, not its value. An unquoted value runs to a space, a quote
# or a closing bracket (a comma may be part of a password).
# --flag VALUE in a command, the flag's name saying secret (checked by `is_secret_name`).
_FLAG_SECRET = re.compile(r"(?P<name>(?<![^\s\"'])--?(?P<flag>[A-Za-z][\w.-]*)\s+)"
                          r"(?P<value>\"[^\"]*\"|'[^']*'|[^\s\"'-][^\s\"']*)")
_PLACEHOLDER_WORDS = {"value", "values", "...", "<value>", "VALUE", "VALUES"}
"""Words gnsweep's own messages put where a value goes (`key=value`): never a secret."""
_TEXT_SECRET = re.compile(r"(?P<name>\b(?:[\w.-]*[._-])?"
                          r"(?:token|key|secret|passw(?:or)?d|credentials?)"
                          r"[\"']?(?:\s*=\s*[\"']?|:[\"']?|:\s+[\"']))"
                          r"(?P<value>[^\s\"')}\]]+)", re.IGNORECASE)


def is_secret_name(name: str) -> bool:
    """Whether a setting's name says it holds a secret (token, key, secret, password)."""
    parts = re.split(r"[_\-\s]+", name.rsplit(".", 1)[-1].lower())
    # By word, so that `max_tokens` or `keys_per_batch` are not secrets but `api_key`,
    # `apikey`, `auth_token` and `db_password` are.
    return any(part.endswith(_SECRET_WORDS) for part in parts if part)


def _uri(match: re.Match[str]) -> str:
    if match["password"] is not None:
        return f"{match['scheme']}{match['user']}:{MASK}@"
    if match["user"]:  # scheme://TOKEN@host: the user part is the credential
        return f"{match['scheme']}{MASK}@"
    return match[0]


def _flag(match: re.Match[str]) -> str:
    if not is_secret_name(match["flag"]) or match["value"].strip("\"'") == MASK:
        return match[0]
    quote = match["value"][0] if match["value"][0] in "\"'" else ""
    return f"{match['name']}{quote}{MASK}{quote}"


def _pair(match: re.Match[str]) -> str:
    if match["value"] == MASK or match["value"] in _PLACEHOLDER_WORDS:
        return match[0]
    return f"{match['name']}{MASK}"


def _by_pattern(value: str) -> str:
    """`value` with the credentials its own form shows masked: URIs, query strings,
    `name=value` pairs and `--secret-flag VALUE` arguments."""
    out = _URI_USERINFO.sub(_uri, value)
    out = _QUERY_SECRET.sub(lambda m: f"{m['name']}{MASK}", out)
    out = _FLAG_SECRET.sub(_flag, out)
    return _TEXT_SECRET.sub(_pair, out)


def _spans(value: str) -> list[str]:
    """The secrets inside `value` that `_by_pattern` masks, each on its own (a command with
    two credentials holds two, not the stretch between them)."""
    out = []
    for match in _URI_USERINFO.finditer(value):
        if match["password"] is not None:
            out.append(match["password"])
        elif match["user"]:
            out.append(match["user"])
    out += [m["value"] for m in _QUERY_SECRET.finditer(value)]
    out += [m["value"].strip("\"'") for m in _FLAG_SECRET.finditer(value)
            if is_secret_name(m["flag"])]
    out += [m["value"] for m in _TEXT_SECRET.finditer(value)
            if m["value"] not in _PLACEHOLDER_WORDS]
    return [span for span in out if span and span != MASK]


def text(value: str) -> str:
    """`value` with credentials in URIs, query strings and `name=value` pairs masked, and the
    secrets this launch handed its workers (and pieces of them) wherever they appear."""
    out = _by_pattern(value)
    # The real values this launch handed its workers, wherever they appear (a task's error
    # that quotes one without its name), and any piece of one long enough to matter (an error
    # that quotes the first characters of a token, or cuts it short with "...").
    for secret in sorted(_known_values(), key=len, reverse=True):
        out = out.replace(secret, MASK)
        out = _mask_pieces(out, secret)
    return out


PIECE = 6
"""The shortest piece of a secret masked on its own: a prefix of a secret (or, for a secret
shorter than this, all of it), or any stretch of 2 x PIECE characters from inside it."""


def _mask_pieces(out: str, secret: str) -> str:
    """`out` with each stretch that is a prefix of `secret` at least PIECE long (all of a
    shorter one), or a stretch of at least 2 x PIECE characters from inside it, masked."""
    shortest = min(PIECE, len(secret))
    starts: dict[str, list[int]] = {}
    for j in range(len(secret) - shortest + 1):
        starts.setdefault(secret[j:j + shortest], []).append(j)
    pieces, i = [], 0
    while i <= len(out) - shortest:
        best = 0
        for j in starts.get(out[i:i + shortest], ()):
            n = shortest
            while i + n < len(out) and j + n < len(secret) and out[i + n] == secret[j + n]:
                n += 1
            if j == 0 or n >= 2 * PIECE:
                best = max(best, n)
        if best:
            pieces.append((i, i + best))
            i += best
        else:
            i += 1
    for begin, end in reversed(pieces):
        out = out[:begin] + MASK + out[end:]
    return out


def _known_values() -> set[str]:
    """The secret part of each value the launcher handed down: all of a setting whose name
    says secret, the stretch its own masking hides of any other (a URI's password, not the
    URI around it, whose pieces are no secret)."""
    out: set[str] = set()
    for name, item in exported().items():
        real = str(item)
        found = [real] if is_secret_name(str(name)) else _spans(real)
        out.update(secret for secret in found if len(secret) >= 4 and secret != MASK)
    return out


def value(name: str, item: Any) -> Any:
    """One setting's value as it may be written: masked whole when its name says secret,
    credentials masked inside strings, containers walked."""
    if isinstance(item, Mapping):
        return {k: value(str(k), v) for k, v in item.items()}
    if isinstance(item, list | tuple):
        return [value(name, v) for v in item]
    if is_secret_name(name) and item not in (None, ""):
        return MASK
    if isinstance(item, str):
        return text(item)
    return item


def config(data: Mapping[str, Any]) -> dict[str, Any]:
    """A config dict (nested) as it may be written to a file, logged or printed."""
    return {str(k): value(str(k), v) for k, v in data.items()}


def secrets(data: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """{dotted name: real value} of every setting `config` changes (what `restore` needs)."""
    out: dict[str, Any] = {}
    for key, item in data.items():
        name = f"{prefix}{key}"
        if isinstance(item, Mapping):
            out.update(secrets(item, f"{name}."))
        elif value(str(key), item) != item:
            out[name] = item
    return out


def restore(data: dict[str, Any], real: Mapping[str, Any]) -> dict[str, Any]:
    """`data` (a redacted config dict) with each masked setting named in `real` given back its
    real value; settings `real` does not name stay as they are."""
    out = json.loads(json.dumps(data, default=str))
    for name, item in real.items():
        *parents, last = name.split(".")
        node = out
        for part in parents:
            node = node.get(part) if isinstance(node, dict) else None
            if node is None:
                break
        if isinstance(node, dict) and last in node and node[last] == value(last, item):
            node[last] = item  # only where the file holds the redacted form of this value
    return out


def export(data: Mapping[str, Any], sweep_dir: Path | None = None) -> None:
    """Hand this config's real secret values to the workers this process starts. With
    `sweep_dir`: those given now are kept for the sweep (`remember`), and where none is given
    (a config read back from the folder, masked) the ones kept earlier are handed down."""
    found = secrets(data)
    if sweep_dir is not None:
        if found:
            remember(sweep_dir, found)
        else:
            found = {k: v for k, v in recall(sweep_dir).items() if _masks(data, k, v)}
    if found:
        os.environ[SECRETS_ENV] = json.dumps(found, default=str)
    else:
        os.environ.pop(SECRETS_ENV, None)


def _masks(data: Mapping[str, Any], name: str, real: Any) -> bool:
    """Whether `data` holds, at dotted `name`, the masked form of `real`."""
    node: Any = data
    *parents, last = name.split(".")
    for part in parents:
        node = node.get(part) if isinstance(node, Mapping) else None
    return isinstance(node, Mapping) and node.get(last) == value(last, real)


def masked_settings(data: Mapping[str, Any], prefix: str = "") -> list[str]:
    """The dotted names of the settings of `data` that still hold a masked value (`***`)."""
    out = []
    for key, item in data.items():
        name = f"{prefix}{key}"
        if isinstance(item, Mapping):
            out += masked_settings(item, f"{name}.")
        elif isinstance(item, str) and MASK in item:
            out.append(name)
    return out


SECRET_DIR_ENV = "GNSWEEP_SECRET_DIR"
"""Where the real values are kept (default: $XDG_STATE_HOME/gnsweep/secrets, else
~/.local/state/gnsweep/secrets): one file a sweep folder, readable by its user alone."""


def _secret_file(sweep_dir: Path) -> Path:
    import hashlib

    base = os.environ.get(SECRET_DIR_ENV) or os.path.join(
        os.environ.get("XDG_STATE_HOME") or os.path.expanduser("~/.local/state"),
        "gnsweep", "secrets")
    key = hashlib.sha256(str(Path(sweep_dir).resolve()).encode()).hexdigest()[:32]
    return Path(base, f"{key}.json")


def remember(sweep_dir: Path, found: Mapping[str, Any]) -> None:
    """Keep the real values of a sweep's masked settings, for its later launches and plans,
    in a file only this user can read (mode 0600, its folder 0700), outside the sweep
    folder. A failure to write it is no error: a later launch then asks for the values."""
    path = _secret_file(sweep_dir)
    try:
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        kept = {**recall(sweep_dir), **found}
        tmp = path.with_name(f".{path.name}.{os.getpid()}")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as handle:
            json.dump(kept, handle, default=str)
        os.replace(tmp, path)
    except OSError:
        return


def recall(sweep_dir: Path) -> dict[str, Any]:
    """The real values `remember` kept for this sweep folder ({} when none)."""
    try:
        found = json.loads(_secret_file(sweep_dir).read_text())
    except (OSError, ValueError):
        return {}
    return dict(found) if isinstance(found, dict) else {}


def exported() -> dict[str, Any]:
    """The real secret values the launcher handed down ({} when none or unreadable)."""
    try:
        found = json.loads(os.environ.get(SECRETS_ENV) or "{}")
    except ValueError:
        return {}
    return dict(found) if isinstance(found, dict) else {}
