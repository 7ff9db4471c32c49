# A job worker built on pyzeebe (the Python Zeebe client), run against a Courier
# gateway by tests/pyzeebe.rs.
#
#   python pyzeebe-worker.py <gateway host:port> <job type> <job count> <stream|poll> [timeout s]
#
# It runs one pyzeebe ZeebeWorker task for <job type>. With "stream" the worker opens
# StreamActivatedJobs (pyzeebe's stream_enabled) beside its ActivateJobs poller, as a
# pyzeebe user turning streaming on gets; with "poll" it only long-polls ActivateJobs.
# The handler returns {"seenBy": "pyzeebe"}, which pyzeebe sends as the job's
# CompleteJob variables. Stdout gets one line per distinct job key handled; the
# process exits 0 once <job count> distinct jobs were handled and the worker has
# stopped (pyzeebe's stop waits for the handlers, and so for their CompleteJob
# calls), and 1 with a message on stderr when the time runs out or the worker fails.
# Whether the completions took effect is for the Rust test to check.
#
# Plaintext, unless ZEEBE_CA_CERTIFICATE_PATH names a CA: then TLS checked against
# it, with an OAuth token for the client credentials in ZEEBE_CLIENT_ID,
# ZEEBE_CLIENT_SECRET, ZEEBE_AUTHORIZATION_SERVER_URL and ZEEBE_TOKEN_AUDIENCE.

import asyncio
import os
import sys

import grpc
from pyzeebe import Job, ZeebeWorker, create_insecure_channel, create_oauth2_client_credentials_channel


def channel_for(address: str):
    ca = os.environ.get("ZEEBE_CA_CERTIFICATE_PATH")
    if not ca:
        return create_insecure_channel(grpc_address=address)
    with open(ca, "rb") as f:
        root = f.read()
    return create_oauth2_client_credentials_channel(
        grpc_address=address,
        client_id=os.environ["ZEEBE_CLIENT_ID"],
        client_secret=os.environ["ZEEBE_CLIENT_SECRET"],
        authorization_server=os.environ["ZEEBE_AUTHORIZATION_SERVER_URL"],
        audience=os.environ["ZEEBE_TOKEN_AUDIENCE"],
        channel_credentials=grpc.ssl_channel_credentials(root_certificates=root),
    )


async def main(address: str, job_type: str, expected: int, stream: bool, timeout_s: float) -> int:
    channel = channel_for(address)
    worker = ZeebeWorker(channel, name="pyzeebe-worker", stream_enabled=stream, poll_retry_delay=1)
    handled: set[int] = set()
    all_handled = asyncio.Event()

    @worker.task(task_type=job_type, timeout_ms=30_000)
    async def handle(job: Job) -> dict:
        # A job handed out again (its timeout ran out before the completion landed)
        # counts once.
        if job.key not in handled:
            handled.add(job.key)
            print(job.key, flush=True)
        if len(handled) >= expected:
            all_handled.set()
        return {"seenBy": "pyzeebe"}

    work = asyncio.create_task(worker.work())
    waiter = asyncio.create_task(all_handled.wait())
    finished, _ = await asyncio.wait({work, waiter}, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
    if waiter not in finished:
        waiter.cancel()
        if work in finished and work.exception() is not None:
            print(f"pyzeebe-worker: the worker failed: {work.exception()!r}", file=sys.stderr)
        else:
            print(
                f"pyzeebe-worker: {len(handled)} of {expected} jobs handled after {timeout_s} s",
                file=sys.stderr,
            )
        return 1
    # Waits for the handlers still running, and with them their CompleteJob calls.
    await worker.stop()
    await asyncio.wait_for(work, 10)
    return 0


if __name__ == "__main__":
    if len(sys.argv) not in (5, 6) or sys.argv[4] not in ("stream", "poll"):
        print(
            "usage: python pyzeebe-worker.py <host:port> <job type> <job count> <stream|poll> [timeout s]",
            file=sys.stderr,
        )
        sys.exit(2)
    timeout = float(sys.argv[5]) if len(sys.argv) == 6 else 50.0
    sys.exit(asyncio.run(main(sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4] == "stream", timeout)))
