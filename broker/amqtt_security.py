"""The embedded broker's security: the plant's identities through amqtt's own plugins.

- Authentication is amqtt's file-auth plugin, taught Mosquitto's `$7$` hashes,
  so the password file `edgebus broker mosquitto-config` writes serves both
  brokers. A client without a user name is refused: the plugin abstains, and
  amqtt refuses a client no plugin vouches for.
- A client id belongs to one identity (`broker.acl.client_id_owner`): a
  client logging in with another identity's id is refused, where amqtt would
  have handed it that client's session (and dropped its subscriptions).
- Authorisation is amqtt's topic-ACL plugin with the rules of `broker.acl`,
  one topic list per user for publishing, subscribing and receiving.

What amqtt 0.12.1's topic ACL cannot do as Mosquitto does: its lists hold
topic filters per user name with no patterns (%u, %c), so the rules are
spelled out per identity, which the plant's identity list allows; and its
subscribe check compares filters level by level, so a subscription to
`a/#` passes where `a/+` is allowed. The receive list closes that gap, since
every message is checked against it before delivery.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from amqtt.plugins.authentication import FileAuthPlugin
from amqtt.plugins.base import BaseAuthPlugin
from amqtt.plugins.topic_checking import TopicAccessControlListPlugin
from amqtt.session import Session
from pwdlib import PasswordHash
from pwdlib.hashers import HasherProtocol

from broker.acl import access_rules, client_id_owner
from broker.passwd import hash_password, is_hash, verify_password
from plant_config import Plant

logger = logging.getLogger(__name__)


class MosquittoHasher(HasherProtocol):
    """pwdlib's hasher interface over `broker.passwd`, for amqtt's file-auth plugin."""

    @classmethod
    def identify(cls, hash: str | bytes) -> bool:
        return is_hash(hash.decode() if isinstance(hash, bytes) else hash)

    def hash(self, password: str | bytes, *, salt: bytes | None = None) -> str:
        return hash_password(password.decode() if isinstance(password, bytes) else password,
                             salt=salt)

    def verify(self, password: str | bytes, hash: str | bytes) -> bool:
        return verify_password(password.decode() if isinstance(password, bytes) else password,
                               hash.decode() if isinstance(hash, bytes) else hash)

    def check_needs_rehash(self, hash: str | bytes) -> bool:
        return False


class MosquittoPasswordFilePlugin(FileAuthPlugin):  # type: ignore[misc]  # amqtt is untyped
    """amqtt's file-auth plugin reading a Mosquitto password file (`$7$` hashes)."""

    def __init__(self, context: object) -> None:
        super().__init__(context)
        self.pwd_hasher = PasswordHash((MosquittoHasher(),))


class ClientIdPlugin(BaseAuthPlugin):  # type: ignore[misc]  # amqtt is untyped
    """Admits a client only with a client id its user name owns (`client_id_owner`).

    Mosquitto closes the older connection of a client id taken over; amqtt
    0.12.1 instead gives the newcomer the older client's session, which
    strips its subscriptions and leaves it connected and deaf.
    """

    @dataclass
    class Config:
        plant_id: str = ""
        identities: list[str] = field(default_factory=list)

    async def authenticate(self, *, session: Session) -> bool | None:
        if session.username is None:
            return None  # anonymous: refused, as no plugin vouches for it
        config = self.context.config
        owner = client_id_owner(config.plant_id, config.identities, session.client_id or "")
        if owner is not None and owner == session.username:
            return True
        logger.warning("refused client id %r of user %r: identity X connects as %s.X or "
                       "%s.X.<suffix> only%s", session.client_id, session.username,
                       config.plant_id, config.plant_id,
                       f"; this id belongs to identity {owner!r}" if owner is not None else "")
        return False


class PlantAclPlugin(TopicAccessControlListPlugin):  # type: ignore[misc]  # amqtt is untyped
    """amqtt's topic-ACL plugin with its subscribe and receive lists configurable.

    amqtt 0.12.1 builds a plugin's settings from its `Config` dataclass, and the
    stock one declares only `publish_acl` and the deprecated `acl`, so the
    subscribe and receive lists it checks could not be set.
    """

    @dataclass
    class Config:
        publish_acl: dict[str, list[str]] = field(default_factory=dict)
        subscribe_acl: dict[str, list[str]] = field(default_factory=dict)
        receive_acl: dict[str, list[str]] = field(default_factory=dict)


def plugins_for(plant: Plant) -> dict[str, dict[str, object]]:
    """amqtt plugin settings that admit and confine exactly the plant's identities."""
    security = plant.security
    if security is None or security.password_file is None:
        raise ValueError("plugins_for needs a plant with security.password_file")
    rules = access_rules(plant)
    reads = {identity: list(access.read) for identity, access in rules.items()}
    return {
        f"{__name__}.{MosquittoPasswordFilePlugin.__name__}": {
            "password_file": str(security.password_file)},
        f"{__name__}.{ClientIdPlugin.__name__}": {
            "plant_id": plant.plant_id, "identities": list(plant.identities())},
        f"{__name__}.{PlantAclPlugin.__name__}": {
            "publish_acl": {identity: list(access.write) for identity, access in rules.items()},
            "subscribe_acl": reads, "receive_acl": reads},
    }
