"""Chapter 12, planning a layout: bytes per rank and step time of any layout from the shapes alone, the same
measured by tensor accounting, calibration on the machine at hand, and the search `python -m minidist.plan`.
"""
