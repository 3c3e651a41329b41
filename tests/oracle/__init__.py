"""Wireshark (tshark) as an outside judge of the bytes our wire encoders produce."""
