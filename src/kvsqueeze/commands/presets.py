"""kvsqueeze presets: the named cache settings, with their bits per element."""

from __future__ import annotations

import argparse


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--head-dim", type=int, default=64, help="head_dim used for the bits/element column")


def run(args: argparse.Namespace) -> int:
    from kvsqueeze.quant import bits_per_element
    from kvsqueeze.spec import PRESETS

    print(f"{'preset':<14} {'K bits/el':>9} {'V bits/el':>9} {'window':>6} {'sinks':>5}  layout")
    for name, spec in PRESETS.items():
        kb = bits_per_element(spec.key, args.head_dim) if spec.key.quantized else 16.0
        vb = bits_per_element(spec.value, args.head_dim) if spec.value.quantized else 16.0
        print(f"{name:<14} {kb:>9.3f} {vb:>9.3f} {spec.window:>6} {spec.sinks:>5}  {spec.label()}")
    print("bits/element include every scale and zero-point; unquantized parts are counted as 16-bit here.")
    print()
    print("peers (transformers' own caches, selectable with --kv wherever a preset is):")
    from kvsqueeze.eval.peers import PEER_INSTALL_HINT, PEERS

    for name, peer in PEERS.items():
        print(f"{name:<22} {peer.description}" + ("" if peer.available else f"  [needs {PEER_INSTALL_HINT}]"))
    return 0
