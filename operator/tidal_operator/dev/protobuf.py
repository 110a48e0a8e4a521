"""Decoding the Kubernetes protobuf bodies kubectl's imperative commands send.

`kubectl create secret generic`, `create configmap` and `create namespace` encode their object
as protobuf (content type application/vnd.kubernetes.protobuf): the magic "k8s\\0", then a
runtime.Unknown envelope whose `raw` field holds the object. Only those kinds are decoded,
field by field from the wire format, into the JSON the rest of the server speaks; anything else
is answered 415, which makes kubectl fall back to JSON where it can.
"""

from __future__ import annotations

import base64
from typing import Any, Callable

MAGIC = b"k8s\x00"
Obj = dict[str, Any]


class ProtobufError(ValueError):
    pass


def _varint(data: bytes, pos: int) -> tuple[int, int]:
    value, shift = 0, 0
    while True:
        if pos >= len(data):
            raise ProtobufError("truncated varint")
        byte = data[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, pos
        shift += 7


def fields(data: bytes) -> list[tuple[int, int | bytes]]:
    """(field number, value) pairs: varints as int, length-delimited fields as bytes."""
    out: list[tuple[int, int | bytes]] = []
    pos = 0
    while pos < len(data):
        key, pos = _varint(data, pos)
        number, wire = key >> 3, key & 7
        if wire == 0:
            value, pos = _varint(data, pos)
            out.append((number, value))
        elif wire == 2:
            length, pos = _varint(data, pos)
            if pos + length > len(data):
                raise ProtobufError("truncated field")
            out.append((number, data[pos:pos + length]))
            pos += length
        elif wire in (1, 5):
            pos += 8 if wire == 1 else 4  # fixed64/fixed32: none in the kinds decoded here
        else:
            raise ProtobufError(f"unsupported wire type {wire}")
    return out


def _text(value: int | bytes) -> str:
    if not isinstance(value, bytes):
        raise ProtobufError("expected a string")
    return value.decode()


def _map_entry(value: int | bytes) -> tuple[str, bytes]:
    if not isinstance(value, bytes):
        raise ProtobufError("expected a map entry")
    entry = dict(fields(value))
    key, item = entry.get(1, b""), entry.get(2, b"")
    if not isinstance(key, bytes) or not isinstance(item, bytes):
        raise ProtobufError("malformed map entry")
    return key.decode(), item


def _object_meta(data: bytes) -> Obj:
    meta: Obj = {}
    for number, value in fields(data):
        if number in (1, 2, 3):  # name, generateName, namespace
            meta[("name", "generateName", "namespace")[number - 1]] = _text(value)
        elif number in (11, 12):  # labels, annotations
            key, item = _map_entry(value)
            meta.setdefault("labels" if number == 11 else "annotations", {})[key] = item.decode()
        elif number == 14:
            meta.setdefault("finalizers", []).append(_text(value))
    return meta


def _secret(data: bytes) -> Obj:
    obj: Obj = {}
    for number, value in fields(data):
        if number == 1 and isinstance(value, bytes):
            obj["metadata"] = _object_meta(value)
        elif number == 2:
            key, item = _map_entry(value)
            obj.setdefault("data", {})[key] = base64.b64encode(item).decode()
        elif number == 3:
            obj["type"] = _text(value)
        elif number == 4:
            key, item = _map_entry(value)
            obj.setdefault("stringData", {})[key] = item.decode()
        elif number == 5:
            obj["immutable"] = bool(value)
    return obj


def _config_map(data: bytes) -> Obj:
    obj: Obj = {}
    for number, value in fields(data):
        if number == 1 and isinstance(value, bytes):
            obj["metadata"] = _object_meta(value)
        elif number == 2:
            key, item = _map_entry(value)
            obj.setdefault("data", {})[key] = item.decode()
        elif number == 3:
            key, item = _map_entry(value)
            obj.setdefault("binaryData", {})[key] = base64.b64encode(item).decode()
        elif number == 4:
            obj["immutable"] = bool(value)
    return obj


def _namespace(data: bytes) -> Obj:
    obj: Obj = {}
    for number, value in fields(data):
        if number == 1 and isinstance(value, bytes):
            obj["metadata"] = _object_meta(value)
    return obj


DECODERS: dict[tuple[str, str], Callable[[bytes], Obj]] = {
    ("v1", "Secret"): _secret,
    ("v1", "ConfigMap"): _config_map,
    ("v1", "Namespace"): _namespace,
}


def decode(body: bytes) -> Obj:
    """The JSON form of a protobuf-encoded Secret, ConfigMap or Namespace."""
    if not body.startswith(MAGIC):
        raise ProtobufError("not a Kubernetes protobuf body (no k8s magic)")
    envelope = dict(fields(body[len(MAGIC):]))
    type_meta = envelope.get(1, b"")
    raw = envelope.get(2, b"")
    if not isinstance(type_meta, bytes) or not isinstance(raw, bytes):
        raise ProtobufError("malformed envelope")
    tm = {n: _text(v) for n, v in fields(type_meta)}
    api_version, kind = tm.get(1, ""), tm.get(2, "")
    decoder = DECODERS.get((api_version, kind))
    if decoder is None:
        raise ProtobufError(f"{api_version} {kind} is not decoded from protobuf here")
    return {"apiVersion": api_version, "kind": kind, **decoder(raw)}
