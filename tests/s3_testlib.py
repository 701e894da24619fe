"""An S3 server for tests: s3rver (npm; buckets, multipart, listings, on disk) behind a proxy
that checks every request's SigV4 signature with the AWS CLI's own botocore (s3rver checks only
the access key id) and injects the faults a real store has: 503 SlowDown storms, dropped
connections, an outage. Also the Debian AWS CLI (/usr/bin/aws) as an independent client."""
import hashlib
import http.client
import http.server
import json
import os
import signal
import socketserver
import subprocess
import sys
import threading
import time
import urllib.parse

sys.path.insert(0, "/usr/lib/python3/dist-packages/awscli")  # its vendored botocore
from botocore.auth import S3SigV4Auth  # noqa: E402
from botocore.awsrequest import AWSRequest  # noqa: E402
from botocore.credentials import Credentials  # noqa: E402

from loom_testlib import free_port, wait_for  # noqa: E402

ACCESS_KEY, SECRET_KEY, REGION = "S3RVER", "S3RVER", "us-east-1"
AWS = "/usr/bin/aws"


def s3rver_bin(source_dir):
    return os.path.join(source_dir, ".tools", "node_modules", ".bin", "s3rver")


def check_signature(method, path, headers, body):
    """None when the request is signed right with (ACCESS_KEY, SECRET_KEY), else why not."""
    auth = headers.get("authorization", "")
    if not auth.startswith("AWS4-HMAC-SHA256 "):
        return "no SigV4 Authorization header"
    fields = dict(p.strip().split("=", 1) for p in auth[len("AWS4-HMAC-SHA256 "):].split(","))
    signed = fields["SignedHeaders"].split(";")
    request = AWSRequest(method=method, url="http://" + headers["host"] + path,
                         headers={h: headers[h] for h in signed if h in headers}, data=body)
    request.context["timestamp"] = headers.get("x-amz-date", "")
    signer = S3SigV4Auth(Credentials(ACCESS_KEY, SECRET_KEY), "s3", REGION)
    canonical = signer.canonical_request(request)
    want = signer.signature(signer.string_to_sign(request, canonical), request)
    if want != fields["Signature"]:
        return "SignatureDoesNotMatch; canonical request:\n" + canonical
    payload = headers.get("x-amz-content-sha256", "")
    if payload != "UNSIGNED-PAYLOAD" and payload != hashlib.sha256(body).hexdigest():
        return "XAmzContentSHA256Mismatch"
    return None


class S3Server:
    """s3rver on a free port with one bucket, behind the checking proxy at `endpoint`."""

    def __init__(self, source_dir, tmp, bucket="ckpt", nice=0):
        self.bin, self.bucket, self.nice = s3rver_bin(source_dir), bucket, nice
        self.data = os.path.join(tmp, "s3rver-data")
        os.makedirs(self.data, exist_ok=True)
        self.backend_port = free_port()
        self.proc = None
        self.log = open(os.path.join(tmp, "s3rver.log"), "ab")
        self.lock = threading.Lock()
        self.requests = []      # (method, path) of every request the proxy saw
        self.hosts = []         # and its Host header
        self.bad_signatures = []
        self.slowdowns = 0      # answer this many next requests 503 SlowDown
        self.drop_puts = 0      # drop the connection of this many next PUTs, mid-body
        self.put_delay = 0.0    # seconds each PUT waits before it is forwarded (a slow store)
        self.start_backend()
        self.proxy = _Proxy(("127.0.0.1", 0), _Handler)
        self.proxy.owner = self
        self.endpoint = "http://127.0.0.1:%d" % self.proxy.server_address[1]
        threading.Thread(target=self.proxy.serve_forever, daemon=True).start()

    def start_backend(self):
        self.proc = subprocess.Popen(
            ["nice", "-n", str(self.nice), "node", self.bin, "-d", self.data, "-a", "127.0.0.1", "-p", str(self.backend_port),
             "--configure-bucket", self.bucket, "--no-vhost-buckets"],
            stdout=self.log, stderr=self.log, start_new_session=True)
        wait_for("s3rver", self._backend_up, timeout=30)

    def _backend_up(self):
        try:
            c = http.client.HTTPConnection("127.0.0.1", self.backend_port, timeout=2)
            c.request("GET", "/")
            c.getresponse().read()
            return True
        except OSError:
            return False

    def start_tls_server(self, tmp):
        """A second s3rver over TLS (a certificate of a CA made here), direct, for the CA-file
        checks; returns (endpoint, ca_file)."""
        ca_key, ca, key, csr, cert = (os.path.join(tmp, n) for n in ("ca.key", "ca.pem", "tls.key", "tls.csr", "tls.pem"))
        ext = os.path.join(tmp, "san.cnf")
        with open(ext, "w") as f:
            f.write("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
        for argv in (["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", ca_key, "-out", ca,
                      "-days", "2", "-subj", "/CN=loom-test-ca"],
                     ["openssl", "req", "-newkey", "rsa:2048", "-nodes", "-keyout", key, "-out", csr,
                      "-subj", "/CN=127.0.0.1"],
                     ["openssl", "x509", "-req", "-in", csr, "-CA", ca, "-CAkey", ca_key, "-CAcreateserial",
                      "-out", cert, "-days", "2", "-extfile", ext]):
            subprocess.run(argv, check=True, capture_output=True)
        port = free_port()
        self.tls_proc = subprocess.Popen(
            ["node", self.bin, "-d", os.path.join(tmp, "s3rver-tls"), "-a", "127.0.0.1", "-p", str(port),
             "--configure-bucket", self.bucket, "--no-vhost-buckets", "--key", key, "--cert", cert],
            stdout=self.log, stderr=self.log, start_new_session=True)
        os.makedirs(os.path.join(tmp, "s3rver-tls"), exist_ok=True)
        wait_for("s3rver over TLS", lambda: subprocess.run(
            ["openssl", "s_client", "-connect", "127.0.0.1:%d" % port], input="", capture_output=True,
            text=True, timeout=10).returncode == 0, timeout=30)
        return "https://127.0.0.1:%d" % port, ca

    def kill_backend(self):
        if self.proc and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=30)

    def env(self, **extra):
        """The environment a Loom program (or the AWS CLI) needs to reach this store."""
        env = dict(os.environ, AWS_ACCESS_KEY_ID=ACCESS_KEY, AWS_SECRET_ACCESS_KEY=SECRET_KEY,
                   AWS_DEFAULT_REGION=REGION, AWS_ENDPOINT_URL=self.endpoint,
                   AWS_EC2_METADATA_DISABLED="true", AWS_SHARED_CREDENTIALS_FILE="/dev/null",
                   AWS_CONFIG_FILE="/dev/null")
        env.update(extra)
        return env

    def aws(self, *args, check=True):
        """The AWS CLI against the backend directly (not through the fault proxy)."""
        r = subprocess.run([AWS, "--endpoint-url", "http://127.0.0.1:%d" % self.backend_port,
                            *args], env=self.env(), capture_output=True, text=True, timeout=300)
        if check and r.returncode != 0:
            raise AssertionError("aws %s: %s" % (" ".join(args), r.stderr))
        return r

    def keys(self, prefix=""):
        """Every key under prefix, as the AWS CLI lists it."""
        r = self.aws("s3api", "list-objects-v2", "--bucket", self.bucket, "--prefix", prefix)
        return sorted(o["Key"] for o in json.loads(r.stdout or "{}").get("Contents", []))

    def object_file(self, key):
        """Where s3rver keeps an object's bytes on disk (to damage it)."""
        return os.path.join(self.data, self.bucket, key + "._S3rver_object")

    def close(self):
        self.proxy.shutdown()
        self.kill_backend()
        tls = getattr(self, "tls_proc", None)
        if tls and tls.poll() is None:
            os.killpg(tls.pid, signal.SIGKILL)
            tls.wait(timeout=30)
        if self.bad_signatures:
            raise AssertionError("requests with a wrong signature: %s" % self.bad_signatures[:3])


class _Proxy(socketserver.ThreadingMixIn, http.server.HTTPServer):
    daemon_threads = True

    def handle_error(self, request, client_address):
        pass  # a client that hung up (a killed trainer, a dropped connection): nothing to report


class _Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args):
        pass

    def _relay(self):
        s3 = self.server.owner
        length = int(self.headers.get("content-length", 0))
        body = self.rfile.read(length) if length else b""
        headers = {k.lower(): v for k, v in self.headers.items()}
        with s3.lock:
            s3.requests.append((self.command, self.path))
            s3.hosts.append(headers.get("host", ""))
            slowdown = s3.slowdowns > 0
            s3.slowdowns -= 1 if slowdown else 0
            drop = self.command == "PUT" and s3.drop_puts > 0
            s3.drop_puts -= 1 if drop else 0
        if "authorization" in headers:
            why = check_signature(self.command, self.path, headers, body)
            if why:
                with s3.lock:
                    s3.bad_signatures.append((self.command, self.path, why))
                return self._answer(403, b"<Error><Code>SignatureDoesNotMatch</Code><Message>"
                                    + why.split(";")[0].encode() + b"</Message></Error>")
        if slowdown:
            return self._answer(503, b"<Error><Code>SlowDown</Code><Message>Please reduce your "
                                b"request rate.</Message></Error>")
        if drop:
            self.close_connection = True
            self.connection.shutdown(2)
            return
        if self.command == "PUT" and s3.put_delay > 0:
            time.sleep(s3.put_delay)
        # Virtual-host style (<bucket>.s3.localhost): s3rver is told the bucket in the path.
        path = self.path
        if headers.get("host", "").startswith(s3.bucket + "."):
            path = "/" + s3.bucket + path
        try:
            c = http.client.HTTPConnection("127.0.0.1", s3.backend_port, timeout=60)
            forward = {k: v for k, v in self.headers.items() if k.lower() != "host"}
            forward["Host"] = "127.0.0.1:%d" % s3.backend_port
            c.request(self.command, path, body=body, headers=forward)
            r = c.getresponse()
            data = r.read()
        except OSError:
            self.close_connection = True  # the store is down: the client sees the connection end
            self.connection.shutdown(2)
            return
        self.send_response(r.status)
        for k, v in r.getheaders():
            if k.lower() not in ("transfer-encoding", "connection", "content-length"):
                self.send_header(k, v)
        # A HEAD's Content-Length is the object's, not its (empty) body's.
        length = r.getheader("Content-Length") if self.command == "HEAD" else None
        self.send_header("Content-Length", length or str(len(data)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)

    def _answer(self, status, body):
        self.send_response(status)
        self.send_header("Content-Type", "application/xml")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _relay
