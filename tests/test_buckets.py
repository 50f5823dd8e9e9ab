"""Checkpoints on Google Cloud Storage, against a GCS emulator these tests start (the
`gcp-storage-emulator` package, in memory, in this process; subprocesses reach it through
`STORAGE_EMULATOR_HOST` for gcsfs and `TENSORSTORE_GCS_HTTP_URL` for TensorStore).

The emulator leaves out one header real GCS sends with every object it returns,
`x-goog-generation`, which TensorStore reads to know which version of an object it holds
(without it every read of an OCDBT manifest fails as "Malformed StorageGeneration"); the fixture
adds it from the emulator's own record of the object. The emulator does not honour
`ifGenerationMatch=0` either, so the marker's create-only write is not atomic here: what these
tests check is the read-back and the check before each save, which hold without it.
"""

from __future__ import annotations

import http.client
import http.server
import json
import logging
import os
import re
import socket
import subprocess
import sys
import threading
import time
import uuid
import warnings
from collections.abc import Callable, Iterator

import fsspec
import pytest

from nnxscale import TINY, Checkpoints, Trainer, Transformer, adamw, cli, create, launch
from nnxscale.checkpoint import CorruptCheckpointError, SkippedCheckpointWarning
from nnxscale.checkpoint.buckets import ObjectStorageError, location, this_machine
from nnxscale.checkpoint.integrity import LOCK_FILE, DirectoryLockedError, checksums
from nnxscale.placement.catalogue import DP, FSDP, TP
from nnxscale.placement.rules import strategy_mesh
from nnxscale.train.data import book_batches

from conftest import run_python

BATCHES = book_batches(batch_size=16)


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.fixture(scope="module")
def gcs() -> Iterator[Callable[[str], str]]:
    """A GCS emulator with a bucket `run`; a function giving a new `gs://run/...` URL."""
    from gcp_storage_emulator.handlers import objects

    served = objects.download

    def download(request, response, storage, *args, **kwargs) -> None:
        served(request, response, storage, *args, **kwargs)
        if response.status < 300:  # what GCS sends and the emulator leaves out
            params = request.params
            found = storage.get_file_obj(params["bucket_name"], params["object_id"])
            response["x-goog-generation"] = found["generation"]
            response["x-goog-metageneration"] = found["metageneration"]

    objects.download = download
    from gcp_storage_emulator.server import create_server

    logging.getLogger("gcp_storage_emulator").setLevel(logging.CRITICAL)  # each 404 it serves
    port = _free_port()
    server = create_server("127.0.0.1", port, in_memory=True, default_bucket="run")
    server.start()
    endpoint = f"http://127.0.0.1:{port}"
    env = {
        "STORAGE_EMULATOR_HOST": endpoint,
        "TENSORSTORE_GCS_HTTP_URL": endpoint,
        "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false",  # no bucket-layout API to ask
    }
    saved = {name: os.environ.get(name) for name in env}
    os.environ.update(env)
    try:
        yield lambda name: f"gs://run/{name}-{uuid.uuid4().hex[:8]}"
    finally:
        server.stop()
        objects.download = served
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


@pytest.fixture
def refusing(gcs) -> Iterator[Callable[..., str]]:
    """A proxy in front of the emulator that answers as GCS does to credentials without some
    permission: HTTP 403 with GCS's JSON error for each request whose method and path match
    one of the given (method, regex) pairs; every other request goes to the emulator. A
    function that starts one and returns its endpoint."""
    servers = []
    target = os.environ["STORAGE_EMULATOR_HOST"].removeprefix("http://")

    def start(*refused: tuple[str, str]) -> str:
        class Proxy(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:
                pass

            def handle_one(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                if any(self.command == m and re.search(p, self.path) for m, p in refused):
                    message = f"caller does not have permission for {self.command} {self.path}"
                    reply = json.dumps({"error": {"code": 403, "message": message}}).encode()
                    self.send_response(403)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(reply)))
                    self.end_headers()
                    self.wfile.write(reply)
                    return
                upstream = http.client.HTTPConnection(target, timeout=30)
                headers = {k: v for k, v in self.headers.items() if k.lower() != "host"}
                upstream.request(self.command, self.path, body or None, headers)
                answer = upstream.getresponse()
                reply = answer.read()
                self.send_response(answer.status)
                for key, value in answer.getheaders():
                    if key.lower() not in ("transfer-encoding", "connection", "content-length"):
                        self.send_header(key, value)
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)
                upstream.close()

            do_GET = do_POST = do_PUT = do_DELETE = do_PATCH = handle_one

        server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Proxy)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
        return f"http://127.0.0.1:{server.server_address[1]}"

    yield start
    for server in servers:
        server.shutdown()


def test_urls_stay_urls_and_local_paths_become_absolute(tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert str(location("gs://bucket/runs/a/")) == "gs://bucket/runs/a"
    assert location("runs/a") == tmp_path / "runs" / "a"


def test_a_missing_bucket_is_named_and_not_created(gcs, tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)  # a URL taken for a local path would write a folder here
    with pytest.raises(ObjectStorageError, match=r"gs://nobucket does not exist.*create it"):
        Checkpoints("gs://nobucket/run")
    fs, _ = fsspec.core.url_to_fs("gs://run")
    assert not fs.exists("nobucket")  # gcsfs would have made it, had Orbax been let create
    assert list(tmp_path.iterdir()) == []


def test_a_credentials_file_that_is_not_there_is_named(gcs, monkeypatch) -> None:
    monkeypatch.setenv("GOOGLE_APPLICATION_CREDENTIALS", "/no/such/key.json")
    with pytest.raises(ObjectStorageError, match=r"names /no/such/key.json, which is not a"):
        Checkpoints(gcs("creds"))


def test_a_second_writer_is_refused_and_the_first_keeps_the_directory(gcs) -> None:
    url = gcs("two")
    first = Checkpoints(url)
    with pytest.raises(DirectoryLockedError, match=rf"pid {os.getpid()} on "):
        Checkpoints(url)
    first.lock.check()  # still the holder
    first.close()
    Checkpoints(url).close()  # released: the next writer gets it


@pytest.fixture(scope="module")
def saved(gcs) -> dict:
    """2 FSDP steps on 8 devices, saved to GCS after steps 1 and 2."""
    url = gcs("saved")
    trainer = Trainer.create(create(TINY), adamw(), FSDP, strategy_mesh(FSDP))
    sums = {}
    with Checkpoints(url) as checkpoints:
        for _ in range(2):
            trainer.train(BATCHES, 1)
            sums[trainer.step_count()] = checksums(trainer.state)
            checkpoints.save(trainer, BATCHES)
    return {"url": url, "trainer": trainer, "sums": sums}


@pytest.mark.slow
def test_saves_on_gcs_restore_onto_other_meshes(saved, tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    checkpoints = Checkpoints(saved["url"], create=False)
    assert checkpoints.steps() == [1, 2] and checkpoints.partial() == []
    files = {path for path, _, _ in checkpoints.files()}
    assert {"commit_success.txt", "meta/metadata", "state/_METADATA"} <= files
    assert checkpoints.record().run == saved["trainer"].run
    for rules, mesh in [(TP, strategy_mesh(TP)), (DP, strategy_mesh(DP, 1))]:
        restored = checkpoints.restore(Transformer.from_config, adamw(), rules, mesh)
        assert checksums(restored.state) == saved["sums"][2]
        assert restored.state["model"]["embed"][...].sharding.mesh.shape == mesh.shape
    assert list(tmp_path.iterdir()) == []  # nothing went to a local folder named `gs:`


@pytest.mark.slow
def test_a_damaged_chunk_on_gcs_is_refused_and_restore_falls_back(saved, gcs) -> None:
    url = gcs("damaged")
    fs, _ = fsspec.core.url_to_fs(url)
    source, target = saved["url"].removeprefix("gs://"), url.removeprefix("gs://")
    fs.copy(source, target, recursive=True)
    data = [p for p in fs.find(f"{target}/2/state") if "/d/" in p]
    biggest = max(data, key=fs.size)
    content = bytearray(fs.cat_file(biggest))
    content[len(content) // 2] ^= 0x10
    fs.pipe_file(biggest, bytes(content))
    checkpoints = Checkpoints(url, create=False)
    with pytest.raises(CorruptCheckpointError, match="step 2"):
        checkpoints.restore(Transformer.from_config, adamw(), FSDP, strategy_mesh(FSDP), step=2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        resumed = checkpoints.restore(Transformer.from_config, adamw(), FSDP, strategy_mesh(FSDP))
    assert checksums(resumed.state) == saved["sums"][1]
    assert any(w.category is SkippedCheckpointWarning for w in caught)


@pytest.mark.slow
def test_a_writer_whose_marker_was_taken_saves_nothing(saved, gcs) -> None:
    url, trainer = gcs("taken"), saved["trainer"]
    first = Checkpoints(url)
    fs, path = fsspec.core.url_to_fs(f"{url}/{LOCK_FILE}")
    fs.rm_file(path)  # the marker removed under a live writer...
    second = Checkpoints(url)  # ...admits a second one
    with pytest.raises(DirectoryLockedError, match=r"marker .* was replaced.*saves nothing"):
        first.save(trainer, BATCHES)
    second.save(trainer, BATCHES)
    second.close()  # releases: the marker is gone
    with pytest.raises(DirectoryLockedError, match=r"marker .* was deleted"):
        first.save(trainer, BATCHES)
    assert Checkpoints(url, create=False).steps() == [trainer.step_count()]  # second's only
    first.close()


@pytest.mark.slow
def test_a_save_killed_mid_write_on_gcs_loses_only_that_step(gcs) -> None:
    url, batches = gcs("crash"), book_batches(batch_size=8)
    crash = cli.crash_during_save(url, steps=4, save_every=2, devices=4, batch_size=8)
    assert crash.returncode == -9
    survivors = Checkpoints(url, create=False)
    assert survivors.partial() == ["4"]  # objects written, no commit marker
    assert survivors.steps() == [2]
    # The dead writer's marker (this host, its process gone) is taken over.
    writer = Checkpoints(url)
    assert writer.discarded == ["4"]
    resumed = writer.restore(
        Transformer.from_config, adamw(), FSDP, strategy_mesh(FSDP, 4), data=batches
    )
    assert checksums(resumed.state) == crash.checksums[2]
    assert resumed.train(batches, 2) == [crash.losses[s] for s in (2, 3)]
    writer.save(resumed, batches)
    writer.close()
    assert writer.steps() == [2, 4] and writer.partial() == []
    assert checksums(resumed.state) == crash.checksums[4]


@pytest.mark.slow
def test_an_endpoint_that_does_not_answer_fails_within_the_stated_time(tmp_path) -> None:
    code = """
import time
import nnxscale.checkpoint.buckets as buckets
from nnxscale import Checkpoints
buckets.REACH_SECONDS = 3
start = time.perf_counter()
try:
    Checkpoints("gs://run/x")
except buckets.ObjectStorageError as error:
    print(f"{time.perf_counter() - start:.1f}", error)
"""
    start = time.perf_counter()
    ran = run_python(
        code,
        STORAGE_EMULATOR_HOST=f"http://127.0.0.1:{_free_port()}",  # nothing listens there
        GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT="false",
    )
    assert ran.returncodes == [0], ran.output
    seconds, message = ran.output[-1].split(" ", 1)
    assert 3 <= float(seconds) < 4, ran.output
    assert "reaching gs://run got no answer in 3 s" in message
    assert time.perf_counter() - start < 60  # the retrying thread does not hold the exit


@pytest.mark.slow
def test_a_reader_sees_steps_another_process_wrote_since(saved, gcs) -> None:
    """gcsfs caches listings forever: a reader that listed once went on missing new steps.
    Another process's writes are copies made through another file system instance here."""
    url = gcs("reader")
    fs, _ = fsspec.core.url_to_fs(url)
    source, target = saved["url"].removeprefix("gs://"), url.removeprefix("gs://")
    fs.copy(f"{source}/1", f"{target}/1", recursive=True)
    fs.copy(f"{source}/nnxscale-run.json", f"{target}/nnxscale-run.json")
    reader = Checkpoints(url, create=False)
    assert reader.steps() == [1]
    fs.copy(f"{source}/2", f"{target}/2", recursive=True)
    assert reader.steps() == [1, 2]


@pytest.mark.slow
def test_a_process_that_cannot_open_the_bucket_stops_every_process_and_frees_the_marker(
    gcs,
) -> None:
    """Process 1 of two cannot open the directory (its credentials file is missing) while
    process 0 opens it and takes the marker: every process stops at once with an error, none
    goes on alone into Orbax's barriers, and process 0 gives the marker back."""
    url = gcs("apart")
    code = f"""
from nnxscale import cluster
cluster.join()
import os, jax
from nnxscale import Checkpoints
if jax.process_index() == 1:
    os.environ["GOOGLE_APPLICATION_CREDENTIALS"] = "/no/such/key.json"
try:
    Checkpoints({url!r})
except Exception as error:
    print("refused:", type(error).__name__, error)
"""
    start = time.perf_counter()
    output = launch.launch([sys.executable, "-c", code], 2, 1, timeout=120, echo=None)
    refused = [line for line in output if "refused:" in line]
    assert len(refused) == 2, output
    assert any("ObjectStorageError process 1 could not open gs://run/apart" in r for r in refused)
    assert any("names /no/such/key.json" in r for r in refused)
    assert time.perf_counter() - start < 60
    fs, _ = fsspec.core.url_to_fs(url)
    assert not fs.exists(f"{url}/{LOCK_FILE}")
    Checkpoints(url).close()


WRITES = [(method, r".") for method in ("POST", "PUT", "PATCH", "DELETE")]
"""What credentials that may only read objects (roles/storage.objectViewer) are refused."""


def _through(endpoint: str, code: str):
    """Run `code` in a process whose GCS clients go through `endpoint`."""
    return run_python(
        code,
        STORAGE_EMULATOR_HOST=endpoint,
        TENSORSTORE_GCS_HTTP_URL=endpoint,
        NNXSCALE_DEVICES="4",
    )


@pytest.mark.slow
def test_credentials_that_may_not_write_are_named_and_what_is_saved_still_restores(
    saved, refusing
) -> None:
    """A writer with read-only credentials is refused within the stated time, before it
    writes or deletes anything; the same credentials still restore the saved steps."""
    code = f"""
import time
from nnxscale import TP, Checkpoints, Transformer, adamw, strategy_mesh
from nnxscale.checkpoint.integrity import checksums
from nnxscale.checkpoint.buckets import REACH_SECONDS
start = time.perf_counter()
try:
    Checkpoints({saved["url"]!r})
except Exception as error:
    print(f"refused {{time.perf_counter() - start:.1f}} {{REACH_SECONDS:g}}",
          type(error).__name__, error)
reader = Checkpoints({saved["url"]!r}, create=False)
restored = reader.restore(Transformer.from_config, adamw(), TP, strategy_mesh(TP))
print("restored", reader.steps(), checksums(restored.state) == {saved["sums"][2]!r})
"""
    ran = _through(refusing(*WRITES), code)
    assert ran.returncodes == [0], ran.text
    (refused,) = [line.split(" ", 3) for line in ran.output if line.startswith("refused ")]
    _, seconds, limit, message = refused
    assert float(seconds) < float(limit), ran.text
    assert message.startswith(f"ObjectStorageError cannot write to {saved['url']} (OSError: Forb")
    assert "roles/storage.objectUser" in message
    assert "restored [1, 2] True" in ran.output, ran.text
    assert Checkpoints(saved["url"], create=False).steps() == [1, 2]  # nothing deleted


@pytest.mark.slow
def test_credentials_that_may_not_read_the_bucket_or_list_it_are_named(gcs, refusing) -> None:
    """Orbax reads the bucket's metadata (storage.buckets.get) to learn its layout, and lists
    its objects: credentials without either are named before anything is written."""
    url = gcs("roles")
    bucket, path = url.removeprefix("gs://").split("/", 1)
    code = f"""
from nnxscale import Checkpoints
try:
    Checkpoints({url!r})
except Exception as error:
    print("refused", type(error).__name__, error)
"""
    for refused, lacks in [
        (("GET", rf"/b/{bucket}(\?|$)"), "storage.buckets.get"),
        (("GET", rf"/b/{bucket}/o(\?|$)"), "storage.objects.list"),
    ]:
        ran = _through(refusing(refused), code)
        assert f"refused ObjectStorageError these credentials lack {lacks}" in ran.text, ran.text
    fs, _ = fsspec.core.url_to_fs(url)
    assert not fs.exists(f"{bucket}/{path}")  # nothing written


def test_a_directory_orbax_could_not_open_is_left_free_for_the_next_writer(
    gcs, monkeypatch
) -> None:
    """The marker is written before Orbax opens the directory; when Orbax then fails, the
    marker is deleted, rather than left naming a live process and refusing every writer."""
    from nnxscale.checkpoint import store

    def refuse(*args, **kwargs):
        raise OSError("Orbax could not list the directory")

    url = gcs("free")
    monkeypatch.setattr(store, "orbax_manager", refuse)
    with pytest.raises(OSError, match="could not list"):
        Checkpoints(url)
    monkeypatch.undo()
    Checkpoints(url).close()  # not DirectoryLockedError: the failed writer let go


def test_a_dead_writer_is_judged_by_its_machine_and_pid_namespace_not_its_host_name(
    gcs,
) -> None:
    """A container may share this host's name and reuse its pids: a marker naming an ended
    pid of this host name is taken over only if it was written on this machine, in this pid
    namespace; one from elsewhere is refused as possibly alive."""
    url = gcs("machine")
    fs, _ = fsspec.core.url_to_fs(url)
    ended = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                           capture_output=True, text=True, check=True)  # fmt: skip
    marker = {"writer": "w", "pid": int(ended.stdout), "host": socket.gethostname()}
    elsewhere = {**marker, "machine": "another-boot-id pid:[4026531837]"}
    fs.pipe_file(f"{url}/{LOCK_FILE}", json.dumps(elsewhere).encode())
    with pytest.raises(DirectoryLockedError, match=rf"pid {marker['pid']} on "):
        Checkpoints(url)
    fs.pipe_file(f"{url}/{LOCK_FILE}", json.dumps({**marker, "machine": this_machine()}).encode())
    Checkpoints(url).close()  # this machine's, and that process has ended: taken over
