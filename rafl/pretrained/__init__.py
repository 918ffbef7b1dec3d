"""Supernets shipped with rafl, one folder each (see rafl.supernet.pretrained)."""
