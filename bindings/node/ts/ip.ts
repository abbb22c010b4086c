// The default "ip" key: a peer's address as a rate limit key, written as the tower layer and
// pytollgate's middleware write it. One host owns a whole IPv6 network (a /64 at least, often a
// /56 or a /48), and picks any address of it per request: keyed whole, each address would be a
// fresh bucket. So an IPv6 address is keyed by its network, `2001:db8:abcd:1200::/56` by
// default (the network's first address in RFC 5952's form, then the prefix length); an IPv4
// address as it is; an IPv4-mapped IPv6 address (`::ffff:192.0.2.1`, what a dual-stack socket
// reports for an IPv4 peer) as the IPv4 address; a zone id (`fe80::1%eth0`) is dropped.

/** The IPv6 prefix length the "ip" key groups by, unless told otherwise. */
export const DEFAULT_IPV6_SUBNET = 56;

/**
 * `ipv6Subnet` as an option says it: a prefix length from 1 to 128 (128: whole addresses),
 * or `false`, the same; undefined is the default, 56. Throws a `TypeError` for anything else.
 */
export function ipv6SubnetOf(value: unknown): number | false {
  if (value === undefined) return DEFAULT_IPV6_SUBNET;
  if (value === false) return false;
  if (typeof value === "number" && Number.isInteger(value) && value >= 1 && value <= 128) return value;
  throw new TypeError(`ipv6Subnet must be a prefix length from 1 to 128, or false for whole addresses; got ${String(value)}`);
}

/**
 * The rate limit key of the peer address `address`: an IPv6 address as its network of
 * `subnet` bits (`"2001:db8:abcd:1200::/56"`), or whole (`"2001:db8::1"`) when `subnet` is
 * 128 or false; an IPv4 address, or an IPv4-mapped IPv6 one, as the IPv4 address; a zone id dropped.
 * Text that is not an IP address is its own key, as it is.
 *
 * ```ts
 * ipKey("2001:db8:abcd:1234::1");        // "2001:db8:abcd:1200::/56"
 * ipKey("2001:db8:abcd:1234::1", 64);    // "2001:db8:abcd:1234::/64"
 * ipKey("::ffff:192.0.2.1");             // "192.0.2.1"
 * ```
 */
export function ipKey(address: string, subnet: number | false = DEFAULT_IPV6_SUBNET): string {
  const zone = address.indexOf("%");
  const bare = zone < 0 ? address : address.slice(0, zone);
  if (!bare.includes(":")) return address;
  const groups = ipv6Groups(bare);
  if (groups === undefined) return address;
  // ::ffff:a.b.c.d (RFC 4291 2.5.5.2): an IPv4 peer of a dual-stack socket.
  if (groups[5] === 0xffff && groups.slice(0, 5).every((g) => g === 0)) {
    return `${groups[6]! >> 8}.${groups[6]! & 0xff}.${groups[7]! >> 8}.${groups[7]! & 0xff}`;
  }
  if (subnet === false || subnet >= 128) return rfc5952(groups);
  for (let i = 0; i < 8; i++) {
    const kept = Math.min(16, Math.max(0, subnet - 16 * i));
    groups[i] = groups[i]! & ((0xffff << (16 - kept)) & 0xffff);
  }
  return `${rfc5952(groups)}/${subnet}`;
}

/** The eight 16-bit groups of the IPv6 address `text` (RFC 4291 2.2's three forms), or
 *  undefined if it is not one. */
function ipv6Groups(text: string): number[] | undefined {
  const halves = text.split("::");
  if (halves.length > 2) return undefined;
  const parts = halves.map((half) => (half === "" ? [] : half.split(":")));
  const groups: number[][] = [];
  for (const [h, half] of parts.entries()) {
    const out: number[] = [];
    for (const [i, part] of half.entries()) {
      // A dotted IPv4 address may end the address (::ffff:192.0.2.1), as two groups.
      if (h === parts.length - 1 && i === half.length - 1 && part.includes(".")) {
        const v4 = ipv4Bytes(part);
        if (v4 === undefined) return undefined;
        out.push((v4[0]! << 8) | v4[1]!, (v4[2]! << 8) | v4[3]!);
      } else if (/^[0-9a-fA-F]{1,4}$/.test(part)) {
        out.push(parseInt(part, 16));
      } else {
        return undefined;
      }
    }
    groups.push(out);
  }
  if (groups.length === 1) return groups[0]!.length === 8 ? groups[0] : undefined;
  const [head, tail] = groups as [number[], number[]];
  // "::" stands for one group of zeros at least.
  if (head.length + tail.length > 7) return undefined;
  return [...head, ...Array<number>(8 - head.length - tail.length).fill(0), ...tail];
}

/** The four bytes of the dotted IPv4 address `text`, or undefined if it is not one. */
function ipv4Bytes(text: string): number[] | undefined {
  const parts = text.split(".");
  if (parts.length !== 4 || !parts.every((p) => /^\d{1,3}$/.test(p) && Number(p) <= 255)) return undefined;
  return parts.map(Number);
}

/** `groups` in RFC 5952's form: lower-case hex without leading zeros, the longest run of two
 *  or more zero groups (the first of equals) as "::". */
function rfc5952(groups: number[]): string {
  let start = -1;
  let length = 0;
  for (let i = 0; i < 8; ) {
    if (groups[i] !== 0) {
      i++;
      continue;
    }
    let j = i;
    while (j < 8 && groups[j] === 0) j++;
    if (j - i > length) [start, length] = [i, j - i];
    i = j;
  }
  const hex = groups.map((g) => g.toString(16));
  if (length < 2) return hex.join(":");
  return `${hex.slice(0, start).join(":")}::${hex.slice(start + length).join(":")}`;
}
