"""A private OpenLDAP server for the directory tests: Debian's slapd run as the current user on
127.0.0.1 (ldap:// with StartTLS and ldaps://, ports from 33000-33099, or the range LOW-HIGH in
$GPUBOOK_TEST_LDAP_PORTS), its cn=config made fresh by `slapadd -n0` (mdb backend in a temporary
folder, the core, cosine, nis and inetorgperson schemas and openssh-lpk's sshPublicKey), TLS by a CA
and server certificate made here, entries loaded by ldapadd. It allows an "unauthenticated bind" (a
DN without a password, `olcAllows: bind_anon_dn`), as Active Directory and many servers do: the
page's login must refuse an empty password itself."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from tests.kits import tls_kit

BASE = "dc=lab,dc=example"
ADMIN = f"cn=admin,{BASE}"
ADMIN_PASSWORD = "admin-secret"  # noqa: S105 - a throwaway server's
GROUP = f"cn=gpu-users,ou=groups,{BASE}"
SCHEMAS = ("core", "cosine", "nis", "inetorgperson")
# openssh-lpk, which Debian's /etc/ldap/schema lacks.
LPK_SCHEMA = """dn: cn=openssh-lpk,cn=schema,cn=config
objectClass: olcSchemaConfig
cn: openssh-lpk
olcAttributeTypes: ( 1.3.6.1.4.1.24552.500.1.1.1.13 NAME 'sshPublicKey' DESC 'OpenSSH Public key'
  EQUALITY octetStringMatch SYNTAX 1.3.6.1.4.1.1466.115.121.1.40 )
olcObjectClasses: ( 1.3.6.1.4.1.24552.500.1.1.2.0 NAME 'ldapPublicKey' SUP top AUXILIARY
  DESC 'OpenSSH LPK objectclass' MAY ( sshPublicKey $ uid ) )
"""


def _tool(name: str) -> str:
    """OpenLDAP's server tools live in /usr/sbin, which a test account's PATH does not hold."""
    return shutil.which(name, path=os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/sbin"])) or name


PORTS_ENV = "GPUBOOK_TEST_LDAP_PORTS"


def free_port(low: int | None = None, high: int | None = None, *, skip: tuple[int, ...] = ()) -> int:
    """The first free 127.0.0.1 port of low-high (default: $GPUBOOK_TEST_LDAP_PORTS, else 33000-33099)."""
    first, _, last = os.environ.get(PORTS_ENV, "33000-33099").partition("-")
    low, high = low or int(first), high or int(last)
    for port in range(low, high + 1):
        if port in skip:
            continue
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in {low}-{high}")


def _config_ldif(folder: Path) -> str:
    hashed = subprocess.run([_tool("slappasswd"), "-s", ADMIN_PASSWORD], capture_output=True, text=True,
                            check=True).stdout.strip()
    schemas = "\n".join(f"include: file:///etc/ldap/schema/{name}.ldif" for name in SCHEMAS)
    return f"""dn: cn=config
objectClass: olcGlobal
cn: config
olcPidFile: {folder}/slapd.pid
olcAllows: bind_anon_dn
olcTLSCACertificateFile: {folder}/ca.pem
olcTLSCertificateFile: {folder}/server.pem
olcTLSCertificateKeyFile: {folder}/server.key

dn: cn=module{{0}},cn=config
objectClass: olcModuleList
cn: module{{0}}
olcModulePath: /usr/lib/ldap
olcModuleLoad: back_mdb

dn: cn=schema,cn=config
objectClass: olcSchemaConfig
cn: schema

{schemas}

{LPK_SCHEMA}
dn: olcDatabase={{-1}}frontend,cn=config
objectClass: olcDatabaseConfig
objectClass: olcFrontendConfig
olcDatabase: {{-1}}frontend
olcSizeLimit: 500

dn: olcDatabase={{0}}config,cn=config
objectClass: olcDatabaseConfig
olcDatabase: {{0}}config
olcRootDN: cn=config

dn: olcDatabase={{1}}mdb,cn=config
objectClass: olcDatabaseConfig
objectClass: olcMdbConfig
olcDatabase: {{1}}mdb
olcSuffix: {BASE}
olcRootDN: {ADMIN}
olcRootPW: {hashed}
olcDbDirectory: {folder}/data
olcDbMaxSize: 268435456
olcAccess: to * by * read
"""


@dataclass
class Slapd:
    folder: Path
    port: int  # ldap:// (StartTLS)
    tls_port: int  # ldaps://
    ca_file: Path
    process: subprocess.Popen[bytes] | None = None

    @property
    def ldaps_url(self) -> str:
        return f"ldaps://127.0.0.1:{self.tls_port}"

    @property
    def ldap_url(self) -> str:
        return f"ldap://127.0.0.1:{self.port}"

    def start(self) -> None:
        self.port = free_port()
        self.tls_port = free_port(skip=(self.port,))
        urls = f"{self.ldap_url}/ {self.ldaps_url}/"
        self.process = subprocess.Popen([_tool("slapd"), "-d", "0", "-h", urls, "-F", str(self.folder / "slapd.d")],
                                        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"slapd ended at once (exit {self.process.returncode})")
            if self._answers():
                return
            time.sleep(0.1)
        raise RuntimeError("slapd did not answer within 20 s")

    def _answers(self) -> bool:
        for port in (self.port, self.tls_port):
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            except OSError:
                return False
        return True

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            os.kill(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.kill(self.process.pid, signal.SIGKILL)
                self.process.wait()
        self.process = None

    def add(self, ldif: str) -> None:
        """Entries added by ldapadd as the admin (over ldap:// on the loopback)."""
        subprocess.run(["ldapadd", "-x", "-H", self.ldap_url, "-D", ADMIN, "-w", ADMIN_PASSWORD],
                       input=ldif.encode(), capture_output=True, check=True, timeout=120)

    def modify(self, ldif: str) -> None:
        """Entries changed by ldapmodify as the admin (over ldap:// on the loopback)."""
        subprocess.run(["ldapmodify", "-x", "-H", self.ldap_url, "-D", ADMIN, "-w", ADMIN_PASSWORD],
                       input=ldif.encode(), capture_output=True, check=True, timeout=120)

    def password_file(self, folder: Path, mode: int = 0o600) -> Path:
        path = folder / "ldap-password"
        path.write_text(ADMIN_PASSWORD + "\n")
        path.chmod(mode)
        return path


def make(folder: Path | None = None) -> Slapd:
    """A started slapd holding only the base, ou=people and ou=groups."""
    folder = Path(folder or tempfile.mkdtemp(prefix="gpubook-slapd-"))
    (folder / "data").mkdir(parents=True, exist_ok=True)
    (folder / "slapd.d").mkdir(exist_ok=True)
    ca = tls_kit.certificates(folder, ca_name="gpubook test CA")
    (folder / "config.ldif").write_text(_config_ldif(folder))
    subprocess.run([_tool("slapadd"), "-n0", "-F", str(folder / "slapd.d"), "-l", str(folder / "config.ldif")],
                   capture_output=True, check=True)
    server = Slapd(folder=folder, port=0, tls_port=0, ca_file=ca)
    server.start()
    server.add(f"""dn: {BASE}
objectClass: dcObject
objectClass: organization
o: lab
dc: lab

dn: ou=people,{BASE}
objectClass: organizationalUnit
ou: people

dn: ou=groups,{BASE}
objectClass: organizationalUnit
ou: groups
""")
    return server


def remove(server: Slapd) -> None:
    server.stop()
    shutil.rmtree(server.folder, ignore_errors=True)


def person(name: str, uid: int, *, mails: tuple[str, ...] = (), keys: tuple[str, ...] = (),
           gid: int | None = None, password: str | None = None) -> str:
    """A posixAccount entry; `password`: its userPassword (cleartext, which slapd binds against)."""
    lines = [f"dn: uid={name},ou=people,{BASE}", "objectClass: inetOrgPerson", "objectClass: posixAccount",
             "objectClass: ldapPublicKey", f"uid: {name}", f"cn: {name}", f"sn: {name}",
             f"uidNumber: {uid}", f"gidNumber: {gid if gid is not None else uid}", f"homeDirectory: /home/{name}",
             *(f"mail: {mail}" for mail in mails), *(f"sshPublicKey: {key}" for key in keys),
             *([f"userPassword: {password}"] if password is not None else [])]
    return "\n".join(lines) + "\n"


def posix_group(members: tuple[str, ...], *, dn: str = GROUP, gid: int = 5000) -> str:
    cn = dn.split(",", 1)[0].split("=", 1)[1]
    return "\n".join([f"dn: {dn}", "objectClass: posixGroup", f"cn: {cn}", f"gidNumber: {gid}",
                      *(f"memberUid: {m}" for m in members)]) + "\n"


def names_group(member_dns: tuple[str, ...], *, dn: str) -> str:
    cn = dn.split(",", 1)[0].split("=", 1)[1]
    return "\n".join([f"dn: {dn}", "objectClass: groupOfNames", f"cn: {cn}",
                      *(f"member: {m}" for m in member_dns)]) + "\n"
