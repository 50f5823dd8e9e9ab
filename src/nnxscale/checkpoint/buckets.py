"""Checkpoint directories on Google Cloud Storage (`gs://bucket/path`), given to Orbax and
TensorStore as they are: the bucket checked within a stated time before anything is written,
and one writer at a time held by a marker object, since no `flock` reaches across hosts.

On a file system Orbax writes a step under a temporary name and renames it once complete. GCS
has no rename, and Orbax 0.12 knows it for `gs://` alone: there it writes the step's objects
under their final names and then `commit_success.txt`, so a step without that object is an
unfinished save. On any other object store (`s3://`) it would rename by copying and deleting,
which is not atomic, so those are refused.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import threading
import time
import uuid
import warnings
from pathlib import Path
from typing import Any

from etils import epath

from nnxscale.checkpoint.errors import NoCheckpointError
from nnxscale.checkpoint.integrity import DirectoryLockedError

type Location = Path | epath.Path
"""Where a checkpoint directory is: a local path, or a `gs://` URL as Orbax's `epath` reads it."""

COMMIT = "commit_success.txt"
"""The object Orbax writes last into a step on GCS: a step without it is unfinished."""

REACH_SECONDS = 20.0
"""How long opening a `gs://` directory may take to reach its bucket before it gives up."""


def scheme_of(directory: str | os.PathLike[str]) -> str | None:
    """The URL scheme of `directory` (`gs`, `s3`), or None for a local path."""
    scheme, colon_slashes, _ = str(directory).partition("://")
    return scheme if colon_slashes and scheme.isidentifier() else None


def location(directory: str | os.PathLike[str]) -> Location:
    """`directory` as the library reads it: a `gs://` URL as it is, a local path made absolute.
    Any other URL is refused before anything is written, rather than made a local folder."""
    scheme = scheme_of(directory)
    if scheme is None:
        return Path(directory).absolute()
    if scheme != "gs":
        raise NoCheckpointError(
            f"{directory} is on object storage ({scheme}://), where Orbax would finish each "
            "save by renaming a folder, which object storage does by copying and deleting: a "
            "crash mid-rename would leave a step that looks complete. Save to gs:// (where "
            "Orbax writes a commit marker instead), or mount the bucket where every host "
            "reaches it and pass that path."
        )
    return epath.Path(str(directory).rstrip("/"))


def is_url(directory: Location) -> bool:
    """Whether `directory` is on object storage rather than a file system."""
    return scheme_of(directory) is not None


def _filesystem(directory: Location) -> tuple[Any, str]:
    """fsspec's file system for `directory` (gcsfs), the very instance Orbax's `epath` uses,
    and the path within it, its listings made fresh: gcsfs caches listings forever by
    default, and other processes write here too."""
    try:
        fs = epath.backend.fsspec_backend.fs(str(directory))
        path = str(directory).removeprefix("gs://")
    except ImportError as error:
        raise ImportError(
            f"{directory} is on Google Cloud Storage, which Orbax reaches through gcsfs: "
            "pip install 'nnxscale[gcs]' (or gcsfs)."
        ) from error
    fs.invalidate_cache()
    return fs, path


def within(seconds: float, what: str, call: Any) -> Any:
    """`call()`'s result, or ObjectStorageError once `seconds` pass: gcsfs retries an endpoint
    that does not answer for about a minute, and would hold the program that long. The call
    runs in a daemon thread, so one still retrying does not hold the program at its end."""
    result: dict[str, Any] = {}

    def run() -> None:
        try:
            result["value"] = call()
        except BaseException as error:  # re-raised in the caller's thread
            result["error"] = error

    thread = threading.Thread(target=run, name=f"nnxscale: {what}", daemon=True)
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        raise ObjectStorageError(
            f"{what} got no answer in {seconds:g} s: the storage endpoint does not respond. "
            "Check the network, or STORAGE_EMULATOR_HOST if you meant an emulator."
        )
    if "error" in result:
        raise result["error"]
    return result["value"]


class ObjectStorageError(NoCheckpointError):
    """A bucket that cannot be reached, does not exist, or cannot be written."""


def _access_advice(error: BaseException) -> str:
    """What to check for an error raised by the object store's client."""
    return (
        f"({type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}). "
        "Check the credentials (gcloud auth application-default login, or "
        "GOOGLE_APPLICATION_CREDENTIALS) and that they may read and write objects in the "
        "bucket (roles/storage.objectUser)."
    )


def check_bucket(directory: epath.Path, seconds: float | None = None) -> None:
    """Raise ObjectStorageError, within `seconds` (`REACH_SECONDS`), if `directory`'s bucket
    cannot be reached or does not exist, rather than let Orbax create a bucket named by a typo.
    The client's search for credentials (which may probe a cloud's metadata server) counts."""
    seconds = REACH_SECONDS if seconds is None else seconds
    key_file = os.environ.get("GOOGLE_APPLICATION_CREDENTIALS")
    if key_file and not Path(key_file).is_file():
        raise ObjectStorageError(
            f"GOOGLE_APPLICATION_CREDENTIALS names {key_file}, which is not a file: the client "
            f"would fall back to anonymous access to {directory}. Point it at the service "
            "account's key file, or unset it to use gcloud auth application-default login."
        )
    bucket = str(directory).removeprefix("gs://").split("/", 1)[0]

    def probe() -> None:
        fs, _ = _filesystem(directory)
        for call, query, needs in [
            ("b/{}", {}, "storage.buckets.get, to read the bucket's metadata (Orbax reads it)"),
            ("b/{}/o", {"maxResults": 1}, "storage.objects.list, to list the bucket's objects"),
        ]:
            try:
                fs.call("GET", call, bucket, json_out=True, **query)
            except FileNotFoundError:
                raise ObjectStorageError(
                    f"the bucket gs://{bucket} does not exist: check the name in {directory}, "
                    f"or create it (gcloud storage buckets create gs://{bucket})."
                ) from None
            except OSError as error:
                if not str(error).startswith("Forbidden"):  # gcsfs's word for HTTP 403
                    raise
                raise ObjectStorageError(
                    f"these credentials lack {needs} in gs://{bucket} (OSError: Forbidden). "
                    "A checkpoint directory needs storage.buckets.get (in "
                    "roles/storage.legacyBucketReader) and read and write on its objects "
                    "(roles/storage.objectUser); check the credentials (gcloud auth "
                    "application-default login, or GOOGLE_APPLICATION_CREDENTIALS)."
                ) from error

    try:
        within(seconds, f"reaching gs://{bucket}", probe)
    except (ObjectStorageError, ImportError):
        raise
    except Exception as error:
        raise ObjectStorageError(f"cannot reach gs://{bucket} {_access_advice(error)}") from error


def partial_steps(directory: epath.Path) -> list[str]:
    """Names of the steps in `directory` that lack their commit marker: unfinished saves."""
    fs, path = _filesystem(directory)
    if not fs.exists(path):
        return []
    names = [p.rstrip("/").rsplit("/", 1)[-1] for p in fs.ls(path, detail=False)]
    steps = [name for name in names if name.isdigit()]
    return sorted(name for name in steps if not fs.exists(f"{path}/{name}/{COMMIT}"))


def refresh(directory: Location) -> None:
    """Forget the cached listings of `directory`'s file system, so that steps other processes
    wrote since are seen (object storage only; a file system lists afresh every time)."""
    if is_url(directory):
        _filesystem(directory)


def kvstore_url(root: Location) -> str:
    """TensorStore's URL of the key-value store in the folder `root`."""
    return f"{root}/" if is_url(root) else f"file://{root}/"


def files_under(root: Location) -> list[tuple[str, int]]:
    """(path relative to `root`, bytes) of every file or object under the folder `root`."""
    if not is_url(root):
        found = [p for p in root.rglob("*") if p.is_file()]
        return [(str(p.relative_to(root)), p.stat().st_size) for p in found]
    fs, path = _filesystem(root)
    found = fs.find(path, detail=True)
    return [(name.removeprefix(f"{path}/"), int(info["size"])) for name, info in found.items()]


class MarkerLock:
    """One writer per `gs://` directory: a marker object naming the writer, created only if
    absent (GCS's `ifGenerationMatch=0` makes that atomic), read back, and read again before
    each save, so a writer whose marker another took over stops before it writes. A marker
    left by a writer that died on this host is taken over; one from another host is not,
    since nothing here can tell whether that writer lives (delete the object once sure)."""

    def __init__(self, directory: epath.Path, name: str) -> None:
        seconds = REACH_SECONDS
        self.directory = directory
        self.fs, path = _filesystem(directory)
        self.path = f"{path}/{name}"
        self.holder = {
            "writer": uuid.uuid4().hex,
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "machine": this_machine(),
            "since": time.strftime("%Y-%m-%d %H:%M:%S"),
        }
        found = within(seconds, f"reading the writer marker of {directory}", self._read)
        if found is not None and not _dead(found):
            raise self._locked(found)
        try:
            within(seconds, f"writing the writer marker of {directory}", lambda: self._write(found))
        except FileExistsError:
            raise self._locked(self._read() or {}) from None
        except ObjectStorageError:
            raise
        except Exception as error:
            raise ObjectStorageError(
                f"cannot write to {directory} {_access_advice(error)}"
            ) from error
        self.check()

    def _read(self) -> dict[str, Any] | None:
        """The marker's record, with its object's `generation`; None if there is none."""
        self.fs.invalidate_cache()
        try:
            generation = self.fs.info(self.path).get("generation")
            found = json.loads(self.fs.cat_file(self.path))
        except FileNotFoundError:
            return None
        except ValueError:
            found = None
        found = found if isinstance(found, dict) else {"writer": "an unreadable marker"}
        return {**found, "generation": generation}

    def _write(self, replacing: dict[str, Any] | None) -> None:
        """Create the marker, only if absent. A dead writer's marker is first deleted only if
        it is still the very object read (`ifGenerationMatch`): of two writers taking it over
        at once, one deletes it, and then one alone creates the new one."""
        if replacing is not None:
            bucket, key = self.path.split("/", 1)
            with contextlib.suppress(FileNotFoundError, FileExistsError):  # 404, 412: gone
                self.fs.call(
                    "DELETE",
                    "b/{}/o/{}",
                    bucket,
                    key,
                    ifGenerationMatch=replacing["generation"],
                )
        with self.fs.open(self.path, "xb") as file:
            file.write(json.dumps(self.holder).encode())

    def _locked(self, holder: dict[str, Any]) -> DirectoryLockedError:
        who = (
            f"pid {holder.get('pid')} on {holder.get('host')} since {holder.get('since')}"
            if "pid" in holder
            else "another writer"
        )
        return DirectoryLockedError(
            f"{self.directory} is being written by {who}: two writers in one directory would "
            "interleave their checkpoints or delete each other's saves. Save to another "
            "directory, or close the other writer (its Checkpoints.close()); if it died on "
            f"another host, delete gs://{self.path} once you are sure."
        )

    def check(self) -> None:
        """Raise DirectoryLockedError if the marker no longer names this writer."""
        found = within(REACH_SECONDS, f"reading the writer marker of {self.directory}", self._read)
        if found is None or found.get("writer") != self.holder["writer"]:
            error = self._locked(found or {})
            raise DirectoryLockedError(
                f"this writer's marker in {self.directory} was "
                + ("deleted" if found is None else "replaced")
                + f", so it no longer holds the directory and saves nothing more. {error}"
            )

    def release(self) -> None:
        """Let another writer take the directory: delete the marker if it is still this one's.
        A marker that cannot be deleted is left, with a warning, not raised over what the
        close that releases it reports (a dead writer's marker on this host is taken over)."""
        try:
            if (self._read() or {}).get("writer") == self.holder["writer"]:
                self.fs.rm_file(self.path)
        except Exception as error:  # the storage's own errors, of any kind
            warnings.warn(
                f"the writer marker gs://{self.path} could not be deleted ({error}): delete it "
                "before another host writes to this directory.",
                stacklevel=2,
            )


def this_machine() -> str | None:
    """This process's machine and process namespace (Linux: the kernel's boot id and the pid
    namespace), which a host name alone does not tell: containers may share a host name, and
    a pid means a process only within one namespace."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        return f"{boot} {os.readlink('/proc/self/ns/pid')}"
    except OSError:
        return None


def _dead(holder: dict[str, Any]) -> bool:
    """Whether a marker's writer was a process of this machine and pid namespace (its host
    name and `this_machine` both this one's) that has ended."""
    here = holder.get("host") == socket.gethostname() and holder.get("machine") == this_machine()
    if not here or not isinstance(holder.get("pid"), int):
        return False
    try:
        os.kill(holder["pid"], 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False
