"""A realistic nightly description job for bench/offload.py: a furniture shop's brand
guidelines as the system prompt (long, the same for every product: what a provider's
prompt cache keeps), a short product template, and a catalog of which a part changes
from one night to the next."""

from __future__ import annotations

import csv
from pathlib import Path

# (category, how it is used, care, a claim never to make, words to prefer, to avoid)
CATEGORIES = [
    ("Sofas", "sitting, lounging and the odd nap", "vacuum the cushions weekly", "stain-proof",
     "deep seat, loose cushions, sturdy frame", "luxurious, to die for"),
    ("Armchairs", "reading and a coffee by the window", "turn the seat cushion monthly",
     "orthopaedic", "wingback, snug, supportive", "throne, kingly"),
    ("Dining tables", "family meals and long evenings with friends", "wipe with a damp cloth",
     "scratch-proof", "seats six, extendable, solid top", "indestructible"),
    ("Desks", "focused work at home", "keep away from direct sunlight", "ergonomic by itself",
     "cable tray, drawer, generous top", "game-changing"),
    ("Office chairs", "long working days", "tighten the screws twice a year",
     "prevents back pain", "adjustable, breathable, lumbar support", "medical"),
    ("Beds", "restful nights", "air the room daily", "improves sleep", "headboard, slatted base",
     "dreamy, heavenly"),
    ("Wardrobes", "keeping clothes in order", "check the hinges yearly", "moth-proof",
     "hanging rail, shelves, soft-close doors", "endless space"),
    ("Bookcases", "books, plants and keepsakes", "anchor to the wall", "earthquake-proof",
     "adjustable shelves, open back", "library-grade"),
    ("Lamps", "warm light in the evening", "use bulbs of the stated wattage", "saves energy",
     "dimmable, warm white, fabric shade", "magical glow"),
    ("Rugs", "soft underfoot and quieter rooms", "vacuum without the brush bar", "non-slip",
     "hand-tufted, low pile, dense", "cloud-like"),
    ("Curtains", "privacy and softer daylight", "wash at 30 degrees", "blackout unless tested",
     "lined, pleated, floor-length", "perfect darkness"),
    ("Cushions", "a splash of colour on a sofa", "the cover is removable and washable",
     "hypoallergenic", "feather filling, zip cover", "must-have"),
    ("Mirrors", "more light in a small hall", "clean with a dry microfibre cloth",
     "shatter-proof", "bevelled edge, wall-mounted", "flawless"),
    ("Outdoor furniture", "summer evenings on the terrace", "store the cushions in winter",
     "weather-proof all year", "powder-coated, stackable, quick-dry", "maintenance-free"),
    ("Kitchen storage", "a tidy worktop", "dishwasher-safe only where stated", "airtight",
     "stackable, see-through, labelled", "revolutionary"),
    ("Children's furniture", "play, homework and growing up", "check that nothing is loose",
     "safe without supervision", "rounded corners, tested to EN 71", "childproof"),
]  # fmt: skip

GENERAL = """You write product descriptions for Nordhaus Living, an online furniture shop.

Voice: calm, warm and matter-of-fact. Speak to the reader as "you". Short sentences. No
exclamation marks, no superlatives, no invented urgency ("only today", "last chance").
Describe what the product is, what it is made of, how it is used and how to care for it.

Structure: one paragraph of 60 to 90 words. Open with what the product does for the
reader, then the materials and the finish, then one practical detail (size, storage,
assembly or care). Do not repeat the product name more than once. Do not use lists,
headings or emoji. Never mention the price, discounts or delivery times: the shop shows
them beside the text.

Facts: use only the facts in the product data. If the data names a material, name it
exactly as given; never guess a wood species, a fabric blend or a country of origin.
Never write "sustainable", "eco" or "green" unless the data names a certification (FSC,
OEKO-TEX, EU Ecolabel), and then name the certification. No health, safety or
environmental claims beyond the data. Dimensions in centimetres; weights in kilograms.

Language: write in the locale given with the request. For de-DE use the formal "Sie"
and a decimal comma; for fr-FR the formal "vous"; for en-GB British spelling.

Categories: each has its own notes, to follow when the product belongs to it.
"""


def brand_guidelines() -> str:
    """The system prompt: the general rules and one note per category (about 1 500
    tokens)."""
    notes = [
        f"{name}: the reader buys them for {use}. Mention care: {care}. Never claim "
        f'"{claim}". Prefer words such as {prefer}; avoid "{avoid}". When the data gives a '
        f"size, say what fits (how many people, which room); when it gives a colour, name "
        f"it once."
        for name, use, care, claim, prefer, avoid in CATEGORIES
    ]
    return GENERAL + "\n" + "\n".join(notes) + "\n"


TEMPLATE = """\
Locale: {{ locale }}
Product: {{ product.name }}
Category: {{ product.category }}
Material: {{ product.material }}
Colour: {{ product.color }}
Size: {{ product.size }}
Write the description."""

COLORS = ["oak", "white", "charcoal", "sage green", "terracotta", "sand", "navy", "black"]
MATERIALS = ["solid oak", "beech veneer", "powder-coated steel", "recycled polyester",
             "linen blend", "wool", "rattan", "tempered glass"]  # fmt: skip


def write_catalog(path: Path, n: int, night: int, unchanged: int) -> Path:
    """The catalog of ``night`` (1, 2, ...): ``n`` products; from one night to the next,
    all but ``unchanged`` of them change (a new size or colour line from the supplier's
    feed); the first ``unchanged`` products keep theirs."""
    with path.open("w", newline="") as fh:
        writer = csv.writer(fh)
        writer.writerow(["id", "name", "category", "material", "color", "size"])
        for i in range(n):
            version = 1 if i < unchanged else night
            category = CATEGORIES[i % len(CATEGORIES)][0]
            color = COLORS[(i + version) % len(COLORS)]
            size = f"{60 + i % 140 + 10 * (version - 1)} x {40 + i % 60} cm"
            writer.writerow(
                [f"p{i:05d}", f"Model {i}", category, MATERIALS[i % len(MATERIALS)], color, size]
            )
    return path
