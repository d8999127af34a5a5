"""The real-controller tier's PKI: one CA, the API server's, the JobSet webhook's and podexec's (the kubelet API's)
serving certificates, an admin client certificate, the API server's client certificate towards the kubelets and
the service-account signing key, all generated per test run and valid on loopback only."""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

LOOPBACK = ipaddress.IPv4Address("127.0.0.1")
# The first address of the service range (--service-cluster-ip-range): the apiserver puts it in the
# kubernetes Service, and clients in a pod would dial it. Nothing here dials it; it is only named.
SERVICE_IP = ipaddress.IPv4Address("10.96.0.1")


def _key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def _pem_key(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def _name(cn: str, org: str | None = None) -> x509.Name:
    attrs = [x509.NameAttribute(NameOID.COMMON_NAME, cn)]
    if org:
        attrs.append(x509.NameAttribute(NameOID.ORGANIZATION_NAME, org))
    return x509.Name(attrs)


@dataclass(frozen=True)
class Pki:
    """Paths of the files the components read."""

    ca: Path
    ca_key: Path
    apiserver_cert: Path
    apiserver_key: Path
    admin_cert: Path
    admin_key: Path
    webhook_dir: Path  # tls.crt and tls.key, the names controller-runtime's webhook server reads
    sa_key: Path
    sa_pub: Path
    kubelet_cert: Path  # podexec's exec endpoint (the kubelet's serving certificate), for 127.0.0.1
    kubelet_key: Path
    kubelet_client_cert: Path  # the API server's client certificate towards the kubelets
    kubelet_client_key: Path


def generate(root: Path) -> Pki:
    """Write a fresh CA and every certificate the control plane needs under ``root``."""
    root.mkdir(parents=True, exist_ok=True)
    now = datetime.datetime.now(datetime.UTC) - datetime.timedelta(minutes=5)
    later = now + datetime.timedelta(days=2)
    ca_key = _key()
    ca_cert = (
        x509.CertificateBuilder()
        .subject_name(_name("jaxrec-test-ca"))
        .issuer_name(_name("jaxrec-test-ca"))
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now)
        .not_valid_after(later)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                key_cert_sign=True,
                crl_sign=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .sign(ca_key, hashes.SHA256())
    )

    def leaf(cn: str, *, org: str | None = None, server: bool) -> tuple[bytes, bytes]:
        key = _key()
        b = (
            x509.CertificateBuilder()
            .subject_name(_name(cn, org))
            .issuer_name(ca_cert.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now)
            .not_valid_after(later)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        )
        if server:
            sans = [
                x509.IPAddress(LOOPBACK),
                x509.IPAddress(SERVICE_IP),
                x509.DNSName("localhost"),
                x509.DNSName("kubernetes"),
                x509.DNSName("kubernetes.default.svc"),
            ]
            b = b.add_extension(x509.SubjectAlternativeName(sans), critical=False)
            b = b.add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        else:
            b = b.add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
        cert = b.sign(ca_key, hashes.SHA256())
        return cert.public_bytes(serialization.Encoding.PEM), _pem_key(key)

    def write(name: str, data: bytes) -> Path:
        p = root / name
        p.write_bytes(data)
        p.chmod(0o600)
        return p

    ca = write("ca.crt", ca_cert.public_bytes(serialization.Encoding.PEM))
    ca_key_path = write("ca.key", _pem_key(ca_key))
    api_crt, api_key = leaf("kube-apiserver", server=True)
    # system:masters is bound to cluster-admin by the API server's bootstrap RBAC policy.
    adm_crt, adm_key = leaf("jaxrec-test-admin", org="system:masters", server=False)
    hook_crt, hook_key = leaf("jobset-webhook", server=True)
    kubelet_crt, kubelet_key = leaf("podexec-kubelet", server=True)
    # As kubeadm's apiserver-kubelet-client: system:masters, which a kubelet's authorization would allow.
    kclient_crt, kclient_key = leaf("kube-apiserver-kubelet-client", org="system:masters", server=False)
    webhook_dir = root / "webhook"
    webhook_dir.mkdir(exist_ok=True)
    (webhook_dir / "tls.crt").write_bytes(hook_crt)
    (webhook_dir / "tls.key").write_bytes(hook_key)
    sa = _key()
    sa_pub = sa.public_key().public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    return Pki(
        ca=ca,
        ca_key=ca_key_path,
        apiserver_cert=write("apiserver.crt", api_crt),
        apiserver_key=write("apiserver.key", api_key),
        admin_cert=write("admin.crt", adm_crt),
        admin_key=write("admin.key", adm_key),
        webhook_dir=webhook_dir,
        sa_key=write("sa.key", _pem_key(sa)),
        sa_pub=write("sa.pub", sa_pub),
        kubelet_cert=write("kubelet.crt", kubelet_crt),
        kubelet_key=write("kubelet.key", kubelet_key),
        kubelet_client_cert=write("apiserver-kubelet-client.crt", kclient_crt),
        kubelet_client_key=write("apiserver-kubelet-client.key", kclient_key),
    )
